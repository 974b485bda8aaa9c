"""gpu-check's batched section: continuous batching of long documents with ``ar`` and with
``knapspec``, priced by profiles measured at each batch size, on SmolLM2 (a random tiny model
under ``--quick``; without the wheel the section does not run). The goal on an H200:
at 8k context and batch 32, batched knapspec at least 1.3x batched ar's tokens/s.

What makes that a measurement of the goal: both strategies run on one runner (one cache, one
set of graphs), warmed first by a run of each on the same documents with a few new tokens,
so neither one's tokens/s pays for its captures or compiles (those the timed run still made,
for a draft plan the warm-up did not meet, are counted in its row); and every prompt is
prefilled in the first step (a prefill budget of all the prompts' tokens), so the batch is
full from the first round. With the scheduler's default chunk (2048 prompt tokens a step)
one 8k row would join per four steps while the others decode, and a strategy that emits
more tokens a round would finish rows sooner and so run at a smaller batch than ``ar``: the
comparison would be of two batch sizes. The mean batch of each run is in the report.
"""

from __future__ import annotations

import logging
import time

import torch

from knapspec_dist.engine.generation import GenerationConfig, GenerationResult
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.sampling import prompt_keys
from knapspec_dist.engine.scheduler import Scheduler, result
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.engine.strategy import Strategy
from knapspec_dist.profiles.profiler import measure
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.knapspec import KnapSpecConfig, KnapSpecSelector
from knapspec_dist.speculation.selfspec import SelfSpeculative
from knapspec_dist.tools.gpucheck.budget import Section
from knapspec_dist.tools.gpucheck.correct import (
    RealModel,
    Subject,
    bf16_subject,
    compare,
    prompts,
)
from knapspec_dist.tools.gpucheck.rows import Rows

log = logging.getLogger(__name__)

WARM_TOKENS = 8  # new tokens per row of the warm-up runs


def run_batched(device: torch.device, real: RealModel, section: Section, out: dict, rows: Rows,
                *, context: int, batches, new_tokens: int, profile_contexts) -> None:
    """One row per batch size: ar and knapspec throughput and their verdicts, into ``out``."""
    subj = bf16_subject(device, real, out["notes"])
    out["model"], model = subj.name, subj.model
    mode = "graph" if device.type == "cuda" else "eager"
    profiles = []
    for b in (1, *batches):
        if (why := section.over()) is not None:
            out["notes"].append(f"profile at batch {b}: {why}")
            break
        start = time.perf_counter()
        profile = rows.attempt(out["notes"], f"profile at batch {b}", lambda b=b: measure(
            model, profile_contexts, batch=b, repeats=2, mode=mode))
        if profile is None:
            break
        profiles.append(profile)
        log.info("batched: profile at batch %d (%s) in %.1f s", b, mode,
                 time.perf_counter() - start)
    runner = ModelRunner(model)  # both strategies, every batch size: graphs captured once
    for b in batches:
        base = {"batch": b, "context": context, "rows": b}
        if not profiles:
            rows.skip(out["runs"], base, "skipped: no latency profile (see the notes)")
            continue
        rows.add(out["runs"], base, lambda b=b: _run(subj, profiles, runner, b, context,
                                                     new_tokens, section), section)


def _strategy(name: str, profiles) -> Strategy:
    if name == "ar":
        return Autoregressive()
    return SelfSpeculative(KnapSpecSelector(profiles, KnapSpecConfig(calibrate=True)),
                           name="knapspec")


def _schedule(subj: Subject, strategy: Strategy, runner: ModelRunner, docs: list[list[int]],
              new_tokens: int, capacity: int, section: Section | None
              ) -> tuple[list[GenerationResult], Scheduler]:
    """``docs`` batched together, every prompt prefilled in the first step; ``section`` is
    checked between steps (a run past its share is cut there)."""
    config = GenerationConfig.of(max_new_tokens=new_tokens, stop_at_eos=False,
                                 max_num_batched_tokens=sum(map(len, docs)))
    sched = Scheduler(strategy, subj.model, config, len(docs), capacity, runner=runner)
    for rid, (doc, key) in enumerate(zip(docs, prompt_keys(docs))):  # as Scheduler.run keys them
        sched.add(rid, doc, key)
    done: dict[int, GenerationResult] = {}
    while sched.busy:
        done.update((row.rid, result(row)) for row in sched.step())
        if section is not None:
            section.check()
    return [done[i] for i in range(len(docs))], sched


def _run(subj: Subject, profiles, runner: ModelRunner, b: int, context: int, new_tokens: int,
         section: Section) -> dict:
    """Both strategies warmed on the runner, then ar and knapspec over b long documents; the
    knapspec rows' verdicts against ar's."""
    docs = prompts(subj, b, context)
    capacity = max(row_capacity(len(p), new_tokens) for p in docs)
    for name in ("ar", "knapspec"):
        _schedule(subj, _strategy(name, profiles), runner, docs, WARM_TOKENS, capacity, section)
    run, made = {}, {}
    for name in ("ar", "knapspec"):
        before = runner.captures
        made[name], sched = _schedule(subj, _strategy(name, profiles), runner, docs, new_tokens,
                                      capacity, section)
        t = sched.work
        run[name] = {"tokens_per_s": t.tokens_per_s, "decode_tokens_per_s": t.decode_tokens_per_s,
                     "mean_batch": t.mean_batch, "acceptance": _acceptance(made[name]),
                     "captures": runner.captures - before}
    verdicts = [compare(subj, p, a.token_ids, k.token_ids)["verdict"]
                for p, a, k in zip(docs, made["ar"], made["knapspec"])]
    return {**run, "speedup": run["knapspec"]["tokens_per_s"] / run["ar"]["tokens_per_s"],
            "decode_speedup": (run["knapspec"]["decode_tokens_per_s"]
                               / run["ar"]["decode_tokens_per_s"]),
            "verdicts": {v: verdicts.count(v) for v in sorted(set(verdicts))},
            "verdict": "BUG" if "BUG" in verdicts else "ok"}


def _acceptance(results) -> float | None:
    drafted = sum(r.stats.drafted for r in results)
    return sum(r.stats.accepted for r in results) / drafted if drafted else None


def table(section: dict) -> list[str]:
    lines = ["| batch | context | ar tok/s | knapspec tok/s | speedup | decode speedup | "
             "mean batch ar / knapspec | captures timed | acceptance | rows vs ar | status |",
             "|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|"]
    for r in section.get("runs", []):
        if r["status"] != "ok":
            lines.append(f"| {r['batch']} | {r['context']} | | | | | | | | | {r['status']} |")
            continue
        ar, ks = r["ar"], r["knapspec"]
        acc = ks["acceptance"]
        lines.append(f"| {r['batch']} | {r['context']} | {ar['tokens_per_s']:.1f} | "
                     f"{ks['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['decode_speedup']:.2f}x | {ar['mean_batch']:.1f} / "
                     f"{ks['mean_batch']:.1f} | {ar.get('captures', '-')} / "
                     f"{ks.get('captures', '-')} | {'-' if acc is None else f'{acc:.2f}'} | "
                     f"{r['verdicts']} | ok |")
    return lines
