"""Correctness on the device: greedy identity in fp32, near-ties only in bf16, a seeded
sampling run per strategy, and SmolLM2 on long documents (tokens/s, speedup vs ``ar``).

Every strategy's greedy tokens are compared with ``ar``'s; a difference is classified by
tools/ties.py at its first token (one full forward: near-tie within the dtype's
tolerance, else a bug; fp32 tolerates none). SmolLM2 (when installed, and not ``--quick``) is
the model of the correctness checks, else a small random one with large weights (well
separated logits); the long-document bench runs on SmolLM2 only (on the random one under
``--quick``, as a check of the program), and says so in the command's first line.
Every row is measured through ``Rows.add``: one failing run is that row's status.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.model.config import ModelConfig, load_config
from knapspec_dist.model.embedded import SmolLM2NotInstalledError, ensure_smollm2
from knapspec_dist.model.precision import guarantee, rule_ulps
from knapspec_dist.model.tokenizer import encode, load_tokenizer
from knapspec_dist.model.weights import dtype_name, load_model
from knapspec_dist.profiles.profiler import measure
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.speculation.options import StrategyOptions, format_skip
from knapspec_dist.tools.bench.prompts import ByteTokenizer, build_prompts
from knapspec_dist.tools.corpus import AUSTEN_BOOKS, document_of_tokens
from knapspec_dist.tools.gpucheck.budget import Section
from knapspec_dist.tools.gpucheck.measure import build_random
from knapspec_dist.tools.gpucheck.rows import Rows, error_line
from knapspec_dist.tools.gpucheck.shapes import skip_sets, tiny
from knapspec_dist.tools.ties import check_divergence, logit_spread

log = logging.getLogger(__name__)

STRATEGIES = ("ar", "static", "knapspec", "clasp")
BENCH_STRATEGIES = ("ar", "knapspec", "clasp")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Subject:
    """The model under test in one dtype, its tokenizer (None: random token prompts) and a
    latency profile for the selecting strategies."""

    def __init__(self, name: str, model, tokenizer=None):
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.profile = None

    def strategies(self, names, profile_contexts) -> dict:
        if self.profile is None and any(n in ("knapspec", "clasp") for n in names):
            mode = "graph" if self.model.device.type == "cuda" else "eager"
            start = time.perf_counter()
            self.profile = measure(self.model, contexts=profile_contexts, batch=1, repeats=2,
                                   mode=mode)
            log.info("%s: profile (%s) in %.1f s", self.name, mode, time.perf_counter() - start)
        skip = format_skip(skip_sets(self.model.cfg.num_layers)["mixed"])
        profiles = [self.profile] if self.profile is not None else None
        return {n: build_strategy(StrategyOptions(name=n, skip=skip), self.model, profiles)
                for n in names}


@dataclass(frozen=True)
class RealModel:
    """SmolLM2's converted folder, or why there is none (then the real-model sections skip)."""

    path: Path | None
    reason: str = ""
    stand_in: bool = False  # --quick: the real-model sections run on a random tiny model

    def headline(self) -> str:
        """The command's first line: whether its results come from the real model."""
        if self.path is not None:
            return f"gpu-check: real model SmolLM2 ({self.path}): every section runs"
        if self.stand_in:
            return (f"gpu-check: no real model ({self.reason}): bench, batched and findings run "
                    "on a random tiny model, as a check of the program only")
        return (f"gpu-check: real-model sections skipped ({self.reason}): bench, batched and "
                "findings do not run, correctness runs on a random tiny model")


def real_model(quick: bool) -> RealModel:
    """SmolLM2 when its wheels are installed (converted on first use), unless ``--quick``."""
    if quick:
        return RealModel(None, "--quick", stand_in=True)
    try:
        return RealModel(ensure_smollm2())
    except SmolLM2NotInstalledError as e:
        return RealModel(None, f"SmolLM2 not installed: {str(e).split(':')[0]}; bring it with "
                         "scripts/gpu_pack.py, docs/gpu-check.md")
    except Exception as e:  # noqa: BLE001 - a failed conversion skips its sections, no more
        log.warning("SmolLM2 could not be converted", exc_info=e)
        return RealModel(None, f"SmolLM2 could not be converted: {error_line(e)}")


def subject_config(real: RealModel) -> tuple[str, ModelConfig]:
    """The name and shape of the real-model sections' model (``subject``'s)."""
    if real.path is not None:
        return "smollm2", load_config(real.path)
    return "random-tiny", tiny(2, layers=6)


def subject(dtype: str, device: torch.device, real: RealModel) -> Subject:
    name, cfg = subject_config(real)
    if real.path is not None:
        return Subject(name, load_model(real.path, dtype=DTYPES[dtype], device=device),
                       load_tokenizer(real.path))
    return Subject(name, build_random(cfg, device, DTYPES[dtype], std=0.25, seed=1))


def bf16_subject(device: torch.device, real: RealModel, notes: list[str]) -> Subject:
    """SmolLM2 in bf16; the random tiny model when there is none (noted)."""
    if real.path is None:
        notes.append(f"no real model ({real.reason}): a random tiny model on random or "
                     "byte-token documents")
    return subject("bf16", device, real)


def prompts(subj: Subject, count: int, length: int) -> list[list[int]]:
    if subj.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        vocab = subj.model.cfg.vocab_size
        return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(count)]
    return [encode(subj.tokenizer, document_of_tokens(subj.tokenizer, length, book))
            for book in AUSTEN_BOOKS[:count]]


def compare(subj: Subject, prompt: list[int], reference: list[int], tokens: list[int]) -> dict:
    d = check_divergence(subj.model, prompt, reference, tokens)
    if d is None:
        return {"verdict": "identical"}
    return {"verdict": "near-tie" if d.is_tie else "BUG", "divergence": d.to_dict(),
            "detail": d.describe()}


def run_correctness(device: torch.device, real: RealModel, section: Section, out: dict,
                    rows: Rows, *, new_tokens: int, prompt_tokens: int, count: int,
                    profile_contexts) -> None:
    """Greedy rows of every strategy against ``ar`` (fp32, then bf16) and bf16 sampling rows,
    into ``out`` (the document's "correctness"). Each dtype has half the section, so a slow
    fp32 part leaves bf16, the production dtype, its own share."""
    whole = section
    for i, dtype in enumerate(("fp32", "bf16")):
        section = whole.part(dtype, 1 / (2 - i))
        if (why := section.over()) is not None:
            out["notes"].append(f"{dtype}: {why}")
            continue
        made = rows.attempt(out["notes"], f"{dtype}: the model and its strategies", lambda: (
            s := subject(dtype, device, real), s.strategies(STRATEGIES, profile_contexts)))
        if made is None:
            continue
        subj, strategies = made
        out["model"] = subj.name
        runner = ModelRunner(subj.model)  # one cache and set of graphs for every strategy
        config = GenerationConfig.of(max_new_tokens=new_tokens, stop_at_eos=False)
        references: list[tuple[list[int], list[int]]] = []
        for i, prompt in enumerate(prompts(subj, count, prompt_tokens)):
            reference: list[int] = []
            references.append((prompt, reference))
            for name in STRATEGIES:  # ar first: its first run is the reference
                def greedy(name=name) -> dict:
                    if not reference:
                        reference.extend(generate(strategies["ar"], subj.model, [prompt], config,
                                                  runner=runner)[0].token_ids)
                    r = generate(strategies[name], subj.model, [prompt], config,
                                 runner=runner)[0]
                    return {"new_tokens": len(r.token_ids),
                            "acceptance": r.stats.acceptance_rate,
                            **compare(subj, prompt, reference, r.token_ids)}
                base = {"dtype": dtype, "strategy": name, "prompt": i,
                        "guarantee": guarantee(dtype, device)}
                if name != "ar" and not reference:
                    rows.skip(out["greedy"], base, "skipped: no ar reference (its row failed)")
                    continue
                row = rows.add(out["greedy"], base, greedy, section)
                if row is not None and row["verdict"] != "identical":
                    log.warning("%s %s prompt %d: %s", dtype, name, i, row["detail"])
        if dtype == "bf16":
            spread(subj, references, out.setdefault("spread", []), rows, section)
            sampling(subj, strategies, prompts(subj, 1, prompt_tokens)[0], new_tokens, runner,
                     out["sampling"], rows, section)


def spread(subj: Subject, references: list[tuple[list[int], list[int]]], table: list,
           rows: Rows, section: Section) -> None:
    """Per prompt with an ar reference: how far 1-token decode steps and 2- and 5-token verify
    blocks stray from a one-shot forward over ar's tokens, in ulps of the top logit
    (tools/ties.py ``logit_spread``), next to the bound, which must be at least twice it
    (model/precision.py ``BOUND_ULPS``: a table, set from these rows)."""
    bound = rule_ulps(subj.model.dtype, subj.model.device)
    for i, (prompt, reference) in enumerate(references):
        if not reference:
            continue

        def run(prompt=prompt, reference=reference) -> dict:
            got = logit_spread(subj.model, prompt, reference, qs=(2, 5))
            worst = max(s.max for s in got)
            return {"positions": len(reference), "median": max(s.median for s in got),
                    "p90": max(s.p90 for s in got), "max": worst, "bound_ulps": bound,
                    "fits": 2 * worst <= bound}
        rows.add(table, {"dtype": dtype_name(subj.model.dtype), "prompt": i}, run, section)


def sampling(subj: Subject, strategies: dict, prompt: list[int], new_tokens: int,
             runner: ModelRunner, table: list, rows: Rows, section: Section) -> None:
    """temperature 0.8 / top-p 0.95, seed 0, twice per strategy: it runs, and repeats."""
    config = GenerationConfig.of(max_new_tokens=new_tokens, stop_at_eos=False, temperature=0.8,
                                 top_p=0.95, seed=0)
    vocab = subj.model.cfg.vocab_size
    for name, strategy in strategies.items():
        def run(strategy=strategy) -> dict:
            a = generate(strategy, subj.model, [prompt], config, runner=runner)[0]
            b = generate(strategy, subj.model, [prompt], config, runner=runner)[0]
            return {"new_tokens": len(a.token_ids), "tokens_per_s": a.stats.tokens_per_s,
                    "acceptance": a.stats.acceptance_rate,
                    "in_vocab": all(0 <= t < vocab for t in a.token_ids),
                    "repeats": a.token_ids == b.token_ids}
        rows.add(table, {"strategy": name, "dtype": "bf16"}, run, section)


def run_bench(device: torch.device, real: RealModel, section: Section, out: dict, rows: Rows, *,
              contexts, count: int, new_tokens: int) -> None:
    """ar / knapspec / clasp on long documents (bf16): tokens/s, speedup, identity verdicts,
    into ``out`` (the document's "bench")."""
    subj = bf16_subject(device, real, out["notes"])
    out["model"] = subj.name
    tokenizer = subj.tokenizer or ByteTokenizer(subj.model.cfg.vocab_size)
    docs = build_prompts(tokenizer, list(contexts), count,
                         subj.model.cfg.max_position_embeddings, new_tokens, "summarize")
    # Two profile points (the profile is linear in n): each new shape costs a graph capture.
    strategies = subj.strategies(BENCH_STRATEGIES, (min(contexts), max(contexts)))
    runner = ModelRunner(subj.model)
    config = GenerationConfig.of(max_new_tokens=new_tokens, stop_at_eos=False)
    warm = GenerationConfig.of(max_new_tokens=4, stop_at_eos=False)
    for s in strategies.values():
        generate(s, subj.model, [docs[contexts[0]][0].ids[:64]], warm, runner=runner)
    for n in contexts:
        for j, doc in enumerate(docs[n]):
            made: dict = {}
            order = BENCH_STRATEGIES[j % 3:] + BENCH_STRATEGIES[:j % 3]
            for name in order:
                def run(name=name) -> dict:
                    r = made[name] = generate(strategies[name], subj.model, [doc.ids], config,
                                              runner=runner)[0]
                    decode_s = r.stats.wall_s - r.stats.prefill_s
                    return {"tokens_per_s": r.stats.tokens_per_s,
                            "decode_tokens_per_s": ((len(r.token_ids) - 1) / decode_s
                                                    if decode_s else 0.0),
                            "acceptance": r.stats.acceptance_rate}
                rows.add(out["runs"], {"context": n, "prompt": doc.id,
                                       "prompt_tokens": len(doc.ids), "strategy": name},
                         run, section)
            if "ar" in made:  # this prompt's verdicts, against its ar run
                for row in out["runs"][-len(order):]:
                    if row["strategy"] in made:
                        row.update(rows.attempt(
                            out["notes"], f"{row['strategy']} at {n}: comparing with ar",
                            lambda row=row: compare(subj, doc.ids, made["ar"].token_ids,
                                                    made[row["strategy"]].token_ids))
                            or {"verdict": "not compared"})
            out["summary"] = summarize([r for r in out["runs"] if r["status"] == "ok"])
            rows.save()


def summarize(runs: list[dict]) -> list[dict]:
    """Per context and strategy: mean tokens/s, speedup over ar on the same prompts, verdicts."""
    rows = []
    for n in sorted({r["context"] for r in runs}):
        at = [r for r in runs if r["context"] == n]
        ar = {r["prompt"]: r["tokens_per_s"] for r in at if r["strategy"] == "ar"}
        for name in BENCH_STRATEGIES:
            mine = [r for r in at if r["strategy"] == name]
            if not mine:
                continue
            speedups = [r["tokens_per_s"] / ar[r["prompt"]] for r in mine if ar.get(r["prompt"])]
            verdicts = [r["verdict"] for r in mine]
            known = [r["acceptance"] for r in mine if r["acceptance"] is not None]  # ar: None
            rows.append({"context": n, "strategy": name, "prompts": len(mine),
                         "tokens_per_s": sum(r["tokens_per_s"] for r in mine) / len(mine),
                         "speedup": sum(speedups) / len(speedups) if speedups else None,
                         "acceptance": sum(known) / len(known) if known else None,
                         "verdicts": {v: verdicts.count(v) for v in sorted(set(verdicts))}})
    return rows
