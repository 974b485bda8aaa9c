"""``knapspec throughput --kv-cache-memory``: paged KV against fixed slots under one budget.

    knapspec throughput --model smollm2 --kv-cache-memory 1.5GiB --lengths 200-3000 \\
        --documents 16 --new-tokens 64 --strategies ar --out bench/paged

The budget is the bytes of K/V a replica may hold, sized by the engine's own rule
(engine/memory.py's ``plan_kv``, as ``--kv-cache-memory``). Fixed slots give every row the
model's window (as a job without paging would, ``row_capacity(window, 0)``), so the budget holds
``budget / (window x bytes per position)`` rows whatever the documents; paged, the same bytes
are one pool, and a row is admitted while the free pages cover its own prompt, new tokens and
lookahead. Documents
of lengths spread evenly over ``--lengths`` (in a fixed shuffled order, so short and long ones
mix) go through both, interleaved when repeated. Reported per (strategy, mode): the rows the
budget holds at the documents' real lengths, the mean rows in flight, tokens/s over the run and
over the decoding rounds, and whether each row's text equals the fixed run's.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.memory import KVBudget, kv_bytes_per_token, plan_kv
from knapspec_dist.engine.pages import page_size
from knapspec_dist.engine.scheduler import Scheduler
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.engine.strategy import Strategy
from knapspec_dist.errors import UserError
from knapspec_dist.model.attention import attention_backend
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.tools.bench.prompts import build_prompts
from knapspec_dist.tools.interleave import interleaved

log = logging.getLogger(__name__)


def spread(lo: int, hi: int, count: int) -> list[int]:
    """``count`` lengths evenly over [lo, hi], in a fixed shuffled order."""
    lengths = [lo + (hi - lo) * i // max(1, count - 1) for i in range(count)]
    random.Random(0).shuffle(lengths)
    return lengths


def documents(tokenizer, lo: int, hi: int, count: int, window: int,
              new_tokens: int) -> list[tuple[str, list[int]]]:
    """[(id, prompt ids)]: the bench's summarization prompts at ``spread`` lengths."""
    rows = []
    for j, length in enumerate(spread(lo, hi, count)):
        prompt = build_prompts(tokenizer, [length], j + 1, window, new_tokens,
                               "summarize")[length][j]
        rows.append((f"{prompt.id}@{len(prompt.ids)}", prompt.ids))
    return rows


def plan(model: Transformer, budget: int, capacity: int, paged: bool,
         page: int | None = None) -> KVBudget:
    """The cache ``plan_kv`` gives ``budget`` bytes of K/V for rows of ``capacity``."""
    page = page or page_size(attention_backend(model))
    return plan_kv(per_token=kv_bytes_per_token(model), free=0, capacity=capacity,
                   paged=paged, cuda=model.device.type == "cuda", kv_cache_memory=budget,
                   page=page)


def window_rows(model: Transformer, budget: int) -> tuple[int, int]:
    """Rows of the model's whole window that ``budget`` bytes of K/V hold as fixed slots (a
    UserError when none), and the positions of one."""
    per_token = kv_bytes_per_token(model)
    window = row_capacity(model.cfg.max_position_embeddings, 0)
    rows = plan(model, budget, window, paged=False).pages
    if rows < 1:
        raise UserError(f"--kv-cache-memory {budget} bytes holds no row of the model's "
                        f"{window}-position window ({per_token * window} bytes)")
    return rows, window


def compare(model: Transformer, build_strategy: Callable[[str], Strategy], labels: list[str],
            rows: list[tuple[str, list[int]]], config: GenerationConfig, budget: int,
            page: int | None = None, repeats: int = 1) -> list[dict]:
    """Fixed slots and pages under ``budget`` bytes of K/V, per strategy, ``repeats`` times
    interleaved; one entry per (strategy, mode), the median run by tokens/s."""
    fixed_rows, window = window_rows(model, budget)
    ids = [p for _, p in rows]
    needs = [row_capacity(len(p), config.max_new_tokens) for p in ids]
    capacity = max(needs)
    paged = plan(model, budget, capacity, paged=True, page=page)
    pool = paged.tokens
    holds = min(len(ids), paged.max_num_seqs,
                pool / (sum(paged.row_tokens(n) for n in needs) / len(needs)))
    modes = {"fixed": (fixed_rows, None), "paged": (paged.max_num_seqs, paged.paging())}
    entries = []
    for label in labels:
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        texts: dict[str, list] = {}
        for rep, mode in interleaved(list(modes), repeats):
            seqs, paging = modes[mode]
            sched = Scheduler(build_strategy(label), model, config, seqs, capacity,
                              paging=paging)
            out = [r.token_ids for r in sched.run(ids)]
            if texts.setdefault(mode, out) != out:
                raise RuntimeError(f"{label} {mode}: a repeat gave other tokens")
            runs[mode].append(sched.work.to_dict())
            t = runs[mode][-1]
            log.info("%s %s (run %d of %d): %.1f tok/s, %.1f decode tok/s, %.2f rows in "
                     "flight", label, mode, rep + 1, repeats, t["tokens_per_s"],
                     t["decode_tokens_per_s"], t["mean_batch"])
        same = sum(a == b for a, b in zip(texts["fixed"], texts["paged"]))
        for mode, (seqs, paging) in modes.items():
            median = sorted(runs[mode], key=lambda r: r["tokens_per_s"])[(repeats - 1) // 2]
            entries.append({"strategy": label, "mode": mode, "max_num_seqs": seqs,
                            "pool_tokens": pool if paging else fixed_rows * window,
                            "page": paging.page if paging else None, "holds": holds,
                            "rows": len(ids), "identical_rows": same, **median,
                            "repeats": runs[mode]})
    return entries


def table(entries: list[dict]) -> list[str]:
    """The Markdown table of ``compare``'s entries; ratios against the fixed run."""
    lines = ["| strategy | KV | max_num_seqs | budget holds (real lengths) | mean rows in flight "
             "| tok/s | decode tok/s | vs fixed (tok/s, decode) | rows = fixed |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    fixed = {e["strategy"]: e for e in entries if e["mode"] == "fixed"}
    for e in entries:
        f = fixed[e["strategy"]]
        lines.append(
            f"| {e['strategy']} | {e['mode']} | {e['max_num_seqs']} | {e['holds']:.1f} | "
            f"{e['mean_batch']:.2f} | {e['tokens_per_s']:.1f} | "
            f"{e['decode_tokens_per_s']:.1f} | {e['tokens_per_s'] / f['tokens_per_s']:.2f}x, "
            f"{e['decode_tokens_per_s'] / f['decode_tokens_per_s']:.2f}x | "
            f"{e['identical_rows']}/{e['rows']} |")
    return lines
