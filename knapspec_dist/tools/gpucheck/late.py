"""The riskiest measurements of the shapes, run after everything else: the attention backend
A/B (the non-default backend: its first compile or capture on this device) and the draft step
replayed from per-sublayer graphs (``draft_graphs = "pieces"``, whose capture reads the
prologue's buffers before any replay filled them: an index assert there poisons the CUDA
context, so it goes last of all).

Each is a ``ShapeCheck`` measure (measure.run_shapes builds the model, these take its
contexts at batch 1). Between the two, ``drafting``: what drafting's early exit costs (one
host read-back per draft token, against drafts queued without one: the runner's
``early_exit``), and what ``compute_q_blocks=False`` saves in building each forward's block mask.
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from knapspec_dist.model.attention import BACKENDS, attention_backend
from knapspec_dist.model.block_mask import SKIP_Q_BLOCKS, length_block_mask
from knapspec_dist.tools.gpucheck import shapes as S
from knapspec_dist.tools.gpucheck.budget import Section
from knapspec_dist.tools.gpucheck.measure import ShapeCheck, release


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched under it (each one a kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def block_mask_ops(device: torch.device | str, batch: int = 4, t: int = 1,
                   kv_len: int = 4096) -> dict:
    """Aten ops of one ``length_block_mask`` with and without the backward (q) indices: what
    ``compute_q_blocks=False`` saves per forward (gpu-check reports it on the GPU)."""
    starts = torch.arange(batch, device=device) * 37 % max(1, kv_len - t)
    counts = {}
    for name, q_blocks in (("with_q_blocks", True), ("without_q_blocks", not SKIP_Q_BLOCKS)):
        with torch.inference_mode(), _OpCounter() as counter:
            length_block_mask(starts, t, kv_len, q_blocks=q_blocks)
        counts[name] = counter.ops
    return {**counts, "compute_q_blocks_supported": SKIP_Q_BLOCKS}


def backends(check: ShapeCheck, section: Section) -> None:
    """Decode at batch 1 with every other attention backend, against the default's decode row
    (the shapes section's, same shape and context; no cache is made when nothing runs)."""
    current = attention_backend(check.model)
    table = check.out["backends"]
    decode_ms = {r["context"]: r["ms"] for r in check.out["decode"]
                 if r["model"] == check.name and r["batch"] == 1 and r["status"] == "ok"}
    for n in check.plan.ab_contexts:
        base = check.row(n, 1)
        if n not in decode_ms:
            check.rows.skip(table, {**base, "backend": current}, "skipped: no decode row")
            continue
        check.rows.add(table, {**base, "backend": current}, lambda n=n: {"ms": decode_ms[n]})
        live: dict = {}
        try:
            for backend in BACKENDS:
                if backend == current:
                    continue
                if backend == "cpu":
                    check.rows.skip(table, {**base, "backend": backend}, "skipped: the cpu "
                                    "kernel reads paged caches only; this check decodes over "
                                    "fixed slots")
                    continue
                if backend == "flex" and check.device.type != "cuda":
                    check.rows.skip(table, {**base, "backend": backend}, "skipped: flex runs "
                                    "on CUDA only here (compiling it for a CPU takes minutes)")
                    continue
                if (why := check.fit(n, 1)) is not None:
                    check.rows.skip(table, {**base, "backend": backend}, why)
                    continue

                def other(backend=backend) -> dict:
                    if "cache" not in live:
                        live["cache"] = check.cache(n, 1)
                    check.model.backend = backend
                    try:  # a fresh runner: graphs per backend
                        t = check.timer(live["cache"], slice(0, 1)).time(n, 1)
                    finally:
                        check.model.backend = None
                    return {"ms": 1e3 * t, "vs_default": 1e3 * t / decode_ms[n]}
                check.rows.add(table, {**base, "backend": backend}, other, section,
                               check.first_s)
        finally:
            live.clear()
            release(check.device)


def pieces(check: ShapeCheck, section: Section) -> None:
    """Draft steps replayed from per-sublayer graphs, against the plan graph's draft row."""
    table = check.out["pieces"]
    plan_ms = {(r["context"], r["skip_set"]): r["ms"] for r in check.out["draft"]
               if r["model"] == check.name and r["status"] == "ok"}
    for n in check.plan.contexts:
        live: dict = {}
        try:
            for label, skip in S.skip_sets(check.cfg.num_layers).items():
                base = check.row(n, 1, skip_set=label, skipped=len(skip))
                if (why := check.fit(n, 1)) is not None:
                    check.rows.skip(table, base, why)
                    continue

                def piece(label=label, skip=skip) -> dict:
                    if "timer" not in live:
                        live["timer"] = check.timer(check.cache(n, 1), slice(0, 1))
                        live["timer"].runner.draft_graphs = "pieces"
                    first, t = check.first_and_replay(live["timer"], n, 1, skip)
                    plan = plan_ms.get((n, label))
                    return {"ms": 1e3 * t, "plan_ms": plan,
                            "vs_plan": 1e3 * t / plan if plan else None,
                            "first_call_ms": 1e3 * first}
                check.rows.add(table, base, piece, section, check.first_s)
        finally:
            live.clear()
            release(check.device)


def drafting(check: ShapeCheck, section: Section) -> None:
    """Per context at batch 1: a draft step (half the attention skipped) replayed ``iters``
    times with one read-back at the end (no early exit: drafts queue on the device) and with a
    read-back of its confidence after each (early exit); their difference is what the exit
    costs per draft token, to weigh against the drafts it saves. Then the block mask's ops and
    build time with and without the backward (q) indices."""
    skip = S.skip_sets(check.cfg.num_layers)["attn50"]
    for n in check.plan.contexts:
        base = check.row(n, 1, skip_set="attn50")
        if (why := check.fit(n, 1)) is not None:
            check.rows.skip(check.out["early_exit"], base, why)
            continue
        live: dict = {}
        try:
            def exit_cost(n=n) -> dict:
                timer = live["timer"] = check.timer(check.cache(n, 1), slice(0, 1))
                x, starts = timer.tokens(1), [n]
                confidence = lambda logits: logits.float().softmax(-1).amax().item()  # noqa: E731
                confidence(timer.runner(x, starts, timer.cache, timer.rows, skip))  # capture
                per = {"no_exit": float("inf"), "exit": float("inf")}
                for _ in range(3):  # interleaved, the fastest of each: order and noise cancel
                    for mode in per:
                        start = time.perf_counter()
                        for _ in range(check.plan.iters):
                            logits = timer.runner(x, starts, timer.cache, timer.rows, skip)
                            if mode == "exit":
                                confidence(logits)
                        confidence(logits)
                        per[mode] = min(per[mode], (time.perf_counter() - start)
                                        / check.plan.iters)
                extra = per["exit"] - per["no_exit"]
                return {"no_exit_ms": 1e3 * per["no_exit"], "exit_ms": 1e3 * per["exit"],
                        "readback_us": 1e6 * extra, "share": extra / per["no_exit"]}
            check.rows.add(check.out["early_exit"], base, exit_cost, section, check.first_s)
        finally:
            live.clear()
            release(check.device)
        check.rows.add(check.out["block_mask"], check.row(n, 1),
                       lambda n=n: _block_mask_cost(check.device, n, check.plan.iters))


def _block_mask_cost(device: torch.device, n: int, iters: int) -> dict:
    ops = block_mask_ops(device, 1, 1, n)
    starts = torch.tensor([max(0, n - 1)], device=device)
    per = {}
    for name, q_blocks in (("with", True), ("without", not SKIP_Q_BLOCKS)):
        length_block_mask(starts, 1, n, q_blocks=q_blocks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            length_block_mask(starts, 1, n, q_blocks=q_blocks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        per[name] = (time.perf_counter() - start) / iters
    return {"ops_with_q": ops["with_q_blocks"], "ops_without_q": ops["without_q_blocks"],
            "us_with_q": 1e6 * per["with"], "us_without_q": 1e6 * per["without"],
            "supported": ops["compute_q_blocks_supported"]}
