"""The riskiest measurements of the shapes, run after everything else: the attention backend
A/B (the non-default backend: its first compile or capture on this device) and the draft step
replayed from per-sublayer graphs (``draft_graphs = "pieces"``, whose capture reads the
prologue's buffers before any replay filled them: an index assert there poisons the CUDA
context, so it goes last of all).

Each is a ``ShapeCheck`` measure (measure.run_shapes builds the model, these take its
contexts at batch 1). More late measurements go between the two, as sections of their own in
cli/gpu_check.py's STEPS: early exit against no exit when drafting, what
``compute_q_blocks=False`` saves.
"""

from __future__ import annotations

from knapspec_dist.model.attention import BACKENDS, default_backend
from knapspec_dist.tools.gpucheck import shapes as S
from knapspec_dist.tools.gpucheck.budget import Section
from knapspec_dist.tools.gpucheck.measure import ShapeCheck, release


def backends(check: ShapeCheck, section: Section) -> None:
    """Decode at batch 1 with every other attention backend, against the default's decode row
    (the shapes section's, same shape and context; no cache is made when nothing runs)."""
    current = check.model.backend or default_backend(check.device)
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
