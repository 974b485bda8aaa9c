"""Where a request's time goes: model compute, communication, Ray calls, other Python.

``Meter`` wraps the model's modules (and the selector's ``plan``) at the instance level; the
outermost metered call is timed, nested ones are not, so a region is counted once. With the
rank's ``Comm`` (time inside all_reduce / all_gather / broadcast) and the Ray time measured
around actor calls, one request's wall time splits into:

* ``compute_s`` -- inside metered regions (forwards, sublayers, the KnapSpec DP), minus the
  communication and Ray calls inside them;
* ``comm_s`` -- inside torch.distributed collectives;
* ``ray_s`` -- Ray round trips (coordinator -> shards -> coordinator, beyond the shards' own
  wall time, plus Ray calls made during a round);
* ``other_s`` -- the rest of the shard's wall time: Python of the decode loop (sampling,
  acceptance, cache bookkeeping, tensor creation).

The control-plane share of a job is ``(ray_s + other_s) / wall``. On CUDA, kernels run
asynchronously: compute is then launch time unless the Comm synchronizes (``timed``).
"""

from __future__ import annotations

import time
from dataclasses import fields

from knapspec_dist.engine.generation import Split
from knapspec_dist.ratio import ratio


class Meter:
    def __init__(self):
        self.seconds = 0.0
        self.depth = 0

    def wrap(self, obj, name: str = "forward") -> None:
        """Time ``obj.<name>`` (an instance attribute shadowing the bound method)."""
        original = getattr(obj, name)
        meter = self

        def metered(*args, **kwargs):
            if meter.depth:
                return original(*args, **kwargs)
            meter.depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                meter.seconds += time.perf_counter() - start
                meter.depth -= 1

        setattr(obj, name, metered)

    def install(self, model) -> None:
        """Every forward path of the model: whole forwards, sublayers, embedding, head, norms.
        (A selector's ``plan``, which runs the KnapSpec DP, is wrapped separately.)"""
        self.wrap(model)
        for layer in model.layers:
            self.wrap(layer.attention)
            self.wrap(layer.mlp)
        for module in (model.embed, model.norm, model.lm_head):
            self.wrap(module)
        self.wrap(model, "logits")


def split(wall_s: float, metered_s: float, comm_s: float, comm_calls: int) -> Split:
    """Partition one shard's wall time (the Ray round trips around it are the coordinator's to
    add: a shard makes no Ray calls of its own during a round)."""
    compute = max(0.0, metered_s - comm_s)
    other = max(0.0, wall_s - compute - comm_s)
    return Split(compute, comm_s, 0.0, other, comm_calls)


def job_summary(results, wall_s: float, replicas: int) -> dict:
    """Time split of one ``RayEngine.generate`` call, as shares of the replicas' wall time.

    Each replica serves its prompts one after another, so its busy time is the sum of its
    requests; ``wall_s`` (driver-observed, one replica's worth of time when replicas run in
    parallel) times the number of replicas used is the time available. Everything that is not
    model compute or communication is control plane: Ray calls plus Python outside the model,
    plus driver/replica idle time (``idle_s``).
    """
    used = len({r.replica for r in results}) or 1
    summed = Split()
    for r in results:
        summed.add(r.stats.split)
    total = {f.name: getattr(summed, f.name) for f in fields(Split) if f.name != "comm_calls"}
    available = wall_s * min(used, replicas)
    idle = max(0.0, available - sum(total.values()))
    control = total["ray_s"] + total["other_s"] + idle
    tokens = sum(r.stats.new_tokens for r in results)
    return {"wall_s": wall_s, "replicas_used": used, "requests": len(results),
            "new_tokens": tokens, **total, "idle_s": idle,
            "control_plane_share": ratio(control, available),
            "comm_share": ratio(total["comm_s"], available),
            "compute_share": ratio(total["compute_s"], available),
            "comm_calls": round(summed.comm_calls)}
