"""gpu-check's batched section: continuous batching of long documents with ``ar`` and with
``knapspec``, priced by profiles measured at each batch size, on SmolLM2 (a random tiny model
under ``--quick``; without the wheel the section does not run). The goal on an H200:
at 8k context and batch 32, batched knapspec at least 1.3x batched ar's tokens/s."""

from __future__ import annotations

import logging
import time

import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.scheduler import Scheduler
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.profiles.profiler import measure
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.knapspec import KnapSpecConfig, KnapSpecSelector
from knapspec_dist.speculation.selfspec import SelfSpeculative
from knapspec_dist.tools.gpucheck.budget import Section
from knapspec_dist.tools.gpucheck.correct import (
    RealModel,
    bf16_subject,
    compare,
    prompts,
)
from knapspec_dist.tools.gpucheck.rows import Rows

log = logging.getLogger(__name__)


def run_batched(device: torch.device, real: RealModel, section: Section, out: dict, rows: Rows,
                *, context: int, batches, new_tokens: int, profile_contexts) -> None:
    """One row per batch size: ar and knapspec throughput and their verdicts, into ``out``."""
    subj = bf16_subject(device, real, out["notes"])
    out["model"], model = subj.name, subj.model
    mode = "graph" if device.type == "cuda" else "eager"
    config = GenerationConfig.of(max_new_tokens=new_tokens, stop_at_eos=False)
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
    for b in batches:
        base = {"batch": b, "context": context, "rows": b}
        if not profiles:
            rows.skip(out["runs"], base, "skipped: no latency profile (see the notes)")
            continue
        rows.add(out["runs"], base, lambda b=b: _run(subj, profiles, config, b, context,
                                                     new_tokens), section)


def _run(subj, profiles, config, b: int, context: int, new_tokens: int) -> dict:
    """ar, then knapspec, continuous batching b long documents; the knapspec rows vs ar's."""
    docs = prompts(subj, b, context)
    capacity = max(row_capacity(len(p), new_tokens) for p in docs)
    run, made = {}, {}
    for name in ("ar", "knapspec"):
        strategy = Autoregressive() if name == "ar" else SelfSpeculative(
            KnapSpecSelector(profiles, KnapSpecConfig(calibrate=True)), name="knapspec")
        sched = Scheduler(strategy, subj.model, config, b, capacity)
        made[name] = sched.run(docs)
        t = sched.throughput
        run[name] = {"tokens_per_s": t.tokens_per_s, "decode_tokens_per_s": t.decode_tokens_per_s,
                     "mean_batch": t.mean_batch, "acceptance": _acceptance(made[name])}
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
             "acceptance | rows vs ar | status |", "|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in section.get("runs", []):
        if r["status"] != "ok":
            lines.append(f"| {r['batch']} | {r['context']} | | | | | | | {r['status']} |")
            continue
        acc = r["knapspec"]["acceptance"]
        lines.append(f"| {r['batch']} | {r['context']} | {r['ar']['tokens_per_s']:.1f} | "
                     f"{r['knapspec']['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['decode_speedup']:.2f}x | {'-' if acc is None else f'{acc:.2f}'} | "
                     f"{r['verdicts']} | ok |")
    return lines
