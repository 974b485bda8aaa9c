"""``knapspec throughput``'s measurement: a job-like workload through one replica's
continuous batching (the command: cli/throughput.py).

    knapspec throughput --model smollm2 --contexts 1024 --documents 8 --new-tokens 128 \\
        --strategies ar,knapspec --batch 1,8 --out bench/throughput

For each context, ``--documents`` long documents of mixed lengths (evenly spread between 3/4 of
the context and the context, so rows finish at different times and new rows are admitted into
a running batch) go through the scheduler at each ``--batch`` (max_num_seqs) with each
strategy. Reported per (strategy, batch, context): tokens/s over the whole run (prefill
included) and over the decoding rounds only, the mean batch, and each row's tokens against the
same row decoded alone by ``ar`` at batch 1 (exact in fp32; every difference classified by the
near-tie rule, tools/ties.py, otherwise; under ``--sampling rejection`` counted, not
classified: those tokens are plain sampling's in distribution only). Outputs: ``throughput.json``,
``throughput.md`` and ``throughput.png`` (tokens/s against batch, one line per strategy and
context). Exit status 1 when a row differs from ``ar`` beyond a near-tie.

``--repeats N`` runs each configuration N times, interleaved, and reports the median run: on
a shared two-core machine one run's rate moves by 5-15 % with the neighbours, more than the
differences this command is for. Every run builds its strategy afresh, so a KnapSpec run pays
its own first selection (over a job, the selector keeps what it learned); the latency profile
that prices them is resolved once for the command (``StrategyBuilder``): measured at most once,
even where the machine is too busy for the measurement to be kept in the cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.scheduler import Scheduler
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.engine.strategy import Strategy
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.tools.bench.prompts import build_prompts
from knapspec_dist.tools.interleave import interleaved
from knapspec_dist.tools.ties import check_divergence

log = logging.getLogger(__name__)


def mixed_lengths(context: int, count: int) -> list[int]:
    """``count`` prompt lengths spread evenly over [3/4 context, context]."""
    lo = max(1, (3 * context) // 4)
    if count == 1:
        return [context]
    return [lo + (context - lo) * i // (count - 1) for i in range(count)]


def workload(tokenizer, contexts: list[int], count: int, window: int,
             new_tokens: int) -> dict[int, list[tuple[str, list[int]]]]:
    """{context: [(id, prompt ids)]}: the bench's documents, cut to mixed lengths."""
    out = {}
    for n in contexts:
        rows = []
        for j, length in enumerate(mixed_lengths(n, count)):
            prompt = build_prompts(tokenizer, [length], j + 1, window, new_tokens,
                                   "summarize")[length][j]
            rows.append((f"{prompt.id}@{len(prompt.ids)}", prompt.ids))
        out[n] = rows
    return out


def measure(model: Transformer, build_strategy: Callable[[str], Strategy], labels: list[str],
            work: dict[int, list[tuple[str, list[int]]]], batches: list[int],
            draws: dict[str, GenerationConfig], repeats: int = 1) -> list[dict]:
    """Every (context, strategy, batch, draw) run ``repeats`` times, interleaved (the order
    rotates each repeat, so a slow spell of the machine is shared out), each with a freshly
    built strategy (a KnapSpec selector carries nothing from one run to the next, so every run
    pays its own first selection); each row checked against batch-1 ar of the same draw.
    ``draws``: how tokens are drawn, by name ("greedy", "sampled"), so that one run prices
    sampling against greedy decoding. One entry per configuration: the median run's rates,
    every run's in ``repeats``."""
    entries = []
    longest = max(c.max_new_tokens for c in draws.values())
    for n, rows in work.items():
        ids = [p for _, p in rows]
        capacity = max(row_capacity(len(p), longest) for p in ids)
        reference = {name: Scheduler(Autoregressive(), model, c, 1, capacity).run(ids)
                     for name, c in draws.items()}
        configs = [(label, b, d) for label in labels for b in batches for d in draws]
        done: dict[tuple[str, int, str], list[dict]] = {c: [] for c in configs}
        for rep, (label, b, d) in interleaved(configs, repeats):
            done[(label, b, d)].append(_one_run(model, build_strategy(label), draws[d], b,
                                                capacity, rows, reference[d]))
            t = done[(label, b, d)][-1]
            log.info("context %d %s batch %d %s (run %d of %d): %.1f tok/s, %.1f decode "
                     "tok/s, mean batch %.1f", n, label, b, d, rep + 1, repeats,
                     t["tokens_per_s"], t["decode_tokens_per_s"], t["mean_batch"])
        for label, b, d in configs:
            runs = done[(label, b, d)]
            median = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
            entries.append({"strategy": label, "batch": b, "context": n, "draw": d,
                            "rows": len(rows), **median, "runs": len(runs),
                            "identical_rows": min(r["identical_rows"] for r in runs),
                            "divergences": [d for r in runs for d in r["divergences"]],
                            "repeats": runs})
    return entries


def _one_run(model: Transformer, strategy: Strategy, config: GenerationConfig, batch: int,
             capacity: int, rows: list[tuple[str, list[int]]], reference: list) -> dict:
    """One scheduler run of the rows at ``batch``: its throughput, and each row against
    ``reference`` (batch-1 ar)."""
    sched = Scheduler(strategy, model, config, batch, capacity)
    results = sched.run([p for _, p in rows])
    divergences, same = [], 0
    for (rid, p), got, want in zip(rows, results, reference):
        same += got.token_ids == want.token_ids
        if not config.sampling.identical_to_plain:
            continue  # rejection sampling: plain sampling's distribution, not its tokens
        div = check_divergence(model, p, want.token_ids, got.token_ids)
        if div is not None:
            divergences.append({"row": rid, **div.to_dict()})
            (log.warning if div.is_tie else log.error)(
                "%s batch %d row %s: %s", strategy.name, batch, rid, div.describe())
    return {**sched.work.to_dict(), "identical_rows": same,
            "divergences": divergences,
            "drafted": sum(r.stats.drafted for r in results),
            "accepted": sum(r.stats.accepted for r in results),
            # the strategy is this run's alone: its selector's counts are this run's DPs
            "selections": getattr(getattr(strategy, "selector", None), "selections", 0),
            "selections_spared": getattr(getattr(strategy, "selector", None), "skipped", 0)}


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    return f"{a[key] / b[key]:.3f}x" if a and b and b[key] else "-"


def table(runs: list[dict]) -> list[str]:
    """The Markdown table of the runs (also the command's report): each configuration against
    batch 1, against ar at its batch and, when sampled, against greedy decoding of the same
    strategy and batch (the cost of drawing tokens)."""
    lines = ["| context | strategy | draw | max_num_seqs | runs | mean batch | tok/s | "
             "decode tok/s | vs batch-1 same strategy (tok/s, decode) | vs ar same batch "
             "(tok/s) | vs greedy (tok/s, decode) | rows = ar |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    index = {(r["context"], r["strategy"], r["batch"], r["draw"]): r for r in runs}
    first = min(x["batch"] for x in runs)
    for r in runs:
        n, label, b, d = r["context"], r["strategy"], r["batch"], r["draw"]
        one, ar = index.get((n, label, first, d)), index.get((n, "ar", b, d))
        greedy = index.get((n, label, b, "greedy")) if d != "greedy" else None
        against_greedy = (f"{_ratio(r, greedy, 'tokens_per_s')}, "
                          f"{_ratio(r, greedy, 'decode_tokens_per_s')}" if greedy else "-")
        lines.append(
            f"| {n} | {label} | {d} | {b} | {r['runs']} | {r['mean_batch']:.2f} | "
            f"{r['tokens_per_s']:.2f} | {r['decode_tokens_per_s']:.2f} | "
            f"{_ratio(r, one, 'tokens_per_s')}, {_ratio(r, one, 'decode_tokens_per_s')} | "
            f"{_ratio(r, ar, 'tokens_per_s')} | {against_greedy} | "
            f"{r['identical_rows']}/{r['rows']} |")
    return lines
