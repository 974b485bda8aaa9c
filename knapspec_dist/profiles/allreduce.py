"""The all-reduce cost a tensor-parallel profile adds: timed on the process group at the
message sizes decoding sends (one sublayer's output at decode and verify shapes), MAX over the
ranks, since a replica runs at its slowest rank's pace. The sublayer timings are profiler.py's.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from knapspec_dist.clock import Clock


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def world_size(group) -> int:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def comm_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_over_ranks(values: list[float], group) -> list[float]:
    """Element-wise MAX across the group: a TP replica runs at its slowest rank's pace."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def measure_allreduce(group, sizes: Iterable[int], *, dtype: torch.dtype = torch.float32,
                      repeats: int = 5, iters: int = 10, warmup: int = 3) -> list[list[float]]:
    """Time ``torch.distributed.all_reduce`` (SUM) on ``group`` for messages of ``sizes`` bytes.

    Every rank of the group must call this with the same arguments (it is collective). Each
    repeat starts with a barrier and times ``iters`` back-to-back all-reduces (synchronized on
    a GPU); the median per-call time over repeats is then MAX-reduced over ranks, so every
    rank returns the same ``[[bytes, seconds], ...]`` -- the ``samples["allreduce"]`` format
    of ``fit_profile``. Message tensors live where the backend needs them (CUDA for NCCL).
    """
    if repeats < 1 or iters < 1:
        raise ValueError("repeats and iters must be >= 1")
    device = comm_device(group)
    clock = Clock(device)
    elem = torch.empty((), dtype=dtype).element_size()
    rows: list[list[float]] = []
    times: list[float] = []
    for size in sizes:
        numel = max(1, int(size) // elem)
        buf = torch.ones(numel, dtype=dtype, device=device)
        for _ in range(warmup):
            dist.all_reduce(buf, group=group)
        per_call = []
        for _ in range(repeats):
            dist.barrier(group=group)
            start = clock.now()
            for _ in range(iters):
                dist.all_reduce(buf, group=group)
            per_call.append((clock.now() - start) / iters)
        rows.append([float(numel * elem)])
        times.append(_median(per_call))
    times = max_over_ranks(times, group) if times else times
    for row, t in zip(rows, times):
        row.append(float(t))
    return rows


def decode_allreduce_sizes(hidden: int, batch: int, max_q: int, dtype: torch.dtype) -> list[int]:
    """Message sizes (bytes) of one sublayer's all-reduce at decode (q=1) and verify shapes."""
    elem = torch.empty((), dtype=dtype).element_size()
    qs = sorted(q for q in {1, 2, 4, 8, max_q} if q <= max_q)
    return [q * batch * hidden * elem for q in qs]
