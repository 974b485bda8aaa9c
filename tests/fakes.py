"""Fakes shared by the job-layer tests: a tokenizer, engines and a backend that stand in for
the model and Ray, and job helpers. (Made-up latency profiles: synthetic.py, which imports no
Ray.)"""

from __future__ import annotations

import os
import re

import pyarrow as pa
import pyarrow.parquet as pq

from knapspec_dist.engine.generation import GenerationResult, GenerationStats
from knapspec_dist.errors import UserError
from knapspec_dist.jobs import JobConfig, run_job

BOS, SYS, USER, END, ASSISTANT = 1, 2, 3, 4, 5


class FakeTokenizer:
    """One id per distinct word; the chat template adds SYS USER ... END ASSISTANT."""

    chat_template = "fake"

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def _ids(self, text: str) -> list[int]:
        out = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = 100 + len(self.vocab)
                self.words[self.vocab[w]] = w
            out.append(self.vocab[w])
        return out

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False, **kwargs):
        out = {"input_ids": ([BOS] if add_special_tokens else []) + self._ids(text)}
        if return_offsets_mapping:  # a word's characters (special tokens: none)
            spans = [m.span() for m in re.finditer(r"\S+", text)]
            out["offset_mapping"] = ([(0, 0)] if add_special_tokens else []) + spans
        return out

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kwargs):
        return [SYS, USER] + self._ids(messages[0]["content"]) + [END, ASSISTANT]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[i] for i in ids if i in self.words)


def fake_tools(window: int = 64):
    tok = FakeTokenizer()
    return lambda config: (tok, window)


class ReplicaDied(Exception):
    """Stands in for ray.exceptions.RayActorError."""


class FakeBackend:
    """Replicas that answer in submission order; ``kill`` makes a replica's calls fail.

    ``speed[strategy]`` tokens/s fixes each row's wall time, so the speedup is known.
    ``die_when(replica, key)``: the replica dies when it is asked to generate ``key``.
    """

    speed = {"knapspec": 30.0, "static": 30.0, "ar": 20.0}

    def __init__(self, engine):
        self.engine = engine
        self.num_replicas = engine.num_replicas
        self.handles: dict[int, dict] = {}
        self.epoch = [0] * self.num_replicas  # incarnation; a kill starts a new one ...
        self.alive = [True] * self.num_replicas  # ... that is dead until restarted
        self.next = 0

    def submit(self, replica, prompt_ids, config, key=None):
        e = self.engine
        e.submits.append((e.strategy, tuple(prompt_ids), replica, len(e.created) - 1))
        h = self.next
        self.next += 1
        self.handles[h] = {"replica": replica, "ids": prompt_ids, "config": config,
                           "epoch": self.epoch[replica] if self.alive[replica] else None}
        key = tuple(prompt_ids)
        if e.poison is not None and e.poison(key):
            self.kill(replica)
        return h

    def kill(self, replica):
        self.engine.kills += 1
        self.epoch[replica] += 1  # every outstanding call of the old incarnation fails
        self.alive[replica] = False

    def wait(self, handles, timeout):
        return handles[:1]

    def result(self, h):
        info = self.handles.pop(h)
        e = self.engine
        if info["epoch"] != self.epoch[info["replica"]]:
            raise ReplicaDied(f"replica {info['replica']} died")
        e.answered += 1
        if e.after_answers is not None:
            e.after_answers(e.answered, self)
        ids = info["ids"]
        if e.row_error is not None and e.row_error(tuple(ids)):
            raise UserError("this row is bad")
        n = min(info["config"].max_new_tokens, 6)
        tokens = [(sum(ids) + k) % 50 + 100 for k in range(n)]  # same for every strategy
        wall = n / self.speed[e.strategy]
        spec = e.strategy != "ar"
        e.clock += wall  # rows one after another on a made-up clock
        stats = GenerationStats(prompt_tokens=len(ids), new_tokens=n, rounds=n, wall_s=wall,
                                admitted_at=e.clock - wall, finished_at=e.clock,
                                prefill_s=0.0, drafted=2 * n if spec else 0,
                                accepted=n if spec else 0, attention_skipped=3.0 if spec else 0,
                                mlp_skipped=1.0 if spec else 0, selections=1 if spec else 0)
        return GenerationResult(tokens, stats, "length", text=f"summary {len(ids)}")

    def restart(self, replica):
        self.engine.restarts.append(replica)
        self.epoch[replica] += 1
        self.alive[replica] = True

    def is_replica_failure(self, exc):
        return isinstance(exc, ReplicaDied)


class FakeEngines:
    """engine_factory for run_job; records every engine, submission and restart."""

    def __init__(self, poison=None, row_error=None, after_answers=None):
        self.poison, self.row_error, self.after_answers = poison, row_error, after_answers
        self.created: list[tuple[str, int]] = []
        self.submits: list[tuple[str, tuple, int, int]] = []  # strategy, ids, replica, engine
        self.restarts: list[int] = []
        self.kills = 0
        self.answered = 0
        self.clock = 1.7e9  # seconds since the epoch of the made-up clock
        self.strategy = None
        self.num_replicas = 0

    def __call__(self, config, strategy, replicas):
        self.created.append((strategy.name, replicas))
        self.strategy, self.num_replicas = strategy.name, replicas
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def write_input(path, ids, docs, id_column="id", text_column="document"):
    pq.write_table(pa.table({id_column: ids, text_column: docs}), path)
    return str(path)


def docs_of(lengths):
    """Documents of the given word counts, each word distinct per document."""
    return [" ".join(f"w{i}x{j}" for j in range(n)) for i, n in enumerate(lengths)]


def job(tmp_path, **kw):
    defaults = dict(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"),
                    strategy="knapspec", max_new_tokens=6, instruction="Sum:",
                    checkpoint_rows=1, progress_seconds=0.01, progress_bar=False)
    defaults.update(kw)
    return JobConfig(**defaults)


def run(config, engines=None, window=64):
    engines = engines or FakeEngines()
    result = run_job(config, engine_factory=engines, backend_factory=FakeBackend,
                     text_tools=fake_tools(window))
    return result, engines


def read_rows(out, sub="rows"):
    return pq.read_table(os.path.join(out, sub)).to_pylist()
