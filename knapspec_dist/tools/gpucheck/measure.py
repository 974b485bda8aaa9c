"""Timed forwards of random-weight shapes: decode against the memory bound, verify(q) /
decode, draft against bytes skipped, the attention backend A/B and graph capture cost.

Each timing is ReplayTimer's: the forward captured once (a CUDA graph; on a CPU the runner's
eager stand-in), then ``iters`` replays between two CUDA events. The cache of each
measurement holds just the context (rounded up to 256 positions): with device-side lengths
an sdpa graph reads all ``capacity`` keys, so a larger cache would time a longer context.
Before a cache is allocated its bytes are compared with the device's free memory; a row
that would not fit says so (and an OutOfMemoryError is caught as a fallback).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from knapspec_dist.model.attention import BACKENDS, default_backend
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.config import ModelConfig
from knapspec_dist.model.decoder import Transformer, rope_frequencies
from knapspec_dist.profiles.profiler import fill_cache
from knapspec_dist.profiles.replay import ReplayTimer
from knapspec_dist.tools.gpucheck import shapes as S
from knapspec_dist.tools.gpucheck.budget import Section

log = logging.getLogger(__name__)
OOM = (torch.cuda.OutOfMemoryError,)


@dataclass(frozen=True)
class Plan:
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    qs: tuple[int, ...]
    ab_contexts: tuple[int, ...]
    iters: int
    bandwidth: float
    memory_limit: int | None = None  # bytes; None: what the device reports free


def build_random(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 std: float = 0.02, seed: int = 0) -> Transformer:
    """``Transformer(cfg)`` built on the device in ``dtype``, matrices ~ N(0, std)."""
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Transformer(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    model.inv_freq = rope_frequencies(cfg)[0].to(device)  # fp32, on the device
    return model.eval()


def free_bytes(device: torch.device, limit: int | None = None) -> int:
    if device.type == "cuda":  # free on the device, plus what the allocator holds unused
        free = torch.cuda.mem_get_info(device)[0] + (torch.cuda.memory_reserved(device)
                                                     - torch.cuda.memory_allocated(device))
    else:
        free = _mem_available()
    return free if limit is None else min(free, limit)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 40


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gib(n: int) -> str:
    return f"{n / S.GIB:.1f} GiB"


class ShapeCheck:
    """Every measurement of one model shape; rows are appended to ``out`` by section."""

    def __init__(self, name: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 plan: Plan, out: dict[str, list]):
        self.name, self.cfg, self.device, self.dtype, self.plan = name, cfg, device, dtype, plan
        self.out = out
        self.nbytes = torch.empty((), dtype=dtype).element_size()
        self.model: Transformer | None = None

    def run(self, section: Section) -> None:
        resident = S.resident_bytes(self.cfg, self.nbytes)
        free = free_bytes(self.device, self.plan.memory_limit)
        if resident > free:
            self._note(f"{self.name}: weights need {_gib(resident)}, {_gib(free)} free: skipped")
            return
        if (why := section.over()) is not None:
            self._note(f"{self.name}: {why}")
            return
        start = time.perf_counter()
        try:
            self.model = build_random(self.cfg, self.device, self.dtype)
        except OOM as e:
            self._note(f"{self.name}: out of memory building the model ({e.__class__.__name__})")
            return
        log.info("%s: built in %.1f s (%s resident)", self.name, time.perf_counter() - start,
                 _gib(resident))
        try:
            for n in self.plan.contexts:
                for b in self.plan.batches:
                    self._context(section, n, b)
        finally:
            self.model = None
            release(self.device)

    def _note(self, text: str) -> None:
        log.warning("%s", text)
        self.out["notes"].append(text)

    def _row(self, n: int, b: int, **extra) -> dict:
        return {"model": self.name, "context": n, "batch": b, **extra}

    def _context(self, section: Section, n: int, b: int) -> None:
        cfg, plan = self.cfg, self.plan
        capacity = -(-(n + max(plan.qs) + 1) // 256) * 256
        full = S.step_bytes(cfg, b, n, self.nbytes)
        row = self._row(n, b, bytes=full, bound_ms=1e3 * S.bound_s(full, plan.bandwidth))
        need = S.memory_need(cfg, b, capacity, self.nbytes, max(plan.qs)) - S.resident_bytes(
            cfg, self.nbytes)
        free = free_bytes(self.device, plan.memory_limit)
        if need > free:
            row["status"] = (f"does not fit: cache and activations need {_gib(need)}, "
                             f"{_gib(free)} free")
            self.out["decode"].append(row)
            return
        if (why := section.over()) is not None:
            self.out["decode"].append({**row, "status": why})
            return
        cache = timer = None
        try:
            cache = KVCache(cfg, b, capacity, dtype=self.dtype, device=self.device)
            fill_cache(self.model, cache, n)
            rows = slice(0, b)
            timer = self._timer(cache, rows)
            first, t = self._first_and_replay(timer, n, 1)
            backend = self.model.backend or default_backend(self.device)
            self.out["decode"].append({**row, "status": "ok", "backend": backend,
                                       "ms": 1e3 * t, "ratio": t / (row["bound_ms"] / 1e3),
                                       "tb_per_s": full / t / 1e12,
                                       "first_call_ms": 1e3 * first})
            if b == 1:
                self._verify(section, timer, n, t)
                self._drafts(section, timer, n, t, full)
                if n in plan.ab_contexts:
                    self._backends(section, cache, rows, n, backend, t)
        except OOM as e:
            self.out["decode"].append({**row, "status": f"out of memory ({e.__class__.__name__})"})
        finally:
            del cache, timer
            release(self.device)

    def _timer(self, cache: KVCache, rows: slice) -> ReplayTimer:
        vocab, b = self.cfg.vocab_size, rows.stop - rows.start
        return ReplayTimer(self.model, cache, rows,
                           lambda q: torch.randint(vocab, (b, q), device=self.device),
                           iters=self.plan.iters)

    def _first_and_replay(self, timer: ReplayTimer, n: int, q: int,
                          skip: frozenset[int] = frozenset()) -> tuple[float, float]:
        """Seconds of the first call (warm-up forward, capture, one replay: what a new plan's
        first draft pays) and of a replay; their difference is reported as the capture cost."""
        b = timer.rows.stop - timer.rows.start
        x = timer.tokens(q)
        _sync(self.device)
        start = time.perf_counter()
        timer.runner(x, [n] * b, timer.cache, timer.rows, skip)
        _sync(self.device)
        first = time.perf_counter() - start
        return first, timer.time(n, q, skip)

    def _verify(self, section: Section, timer: ReplayTimer, n: int, decode_s: float) -> None:
        for q in self.plan.qs:
            row = self._row(n, 1, q=q)
            if (why := section.over()) is not None:
                self.out["verify"].append({**row, "status": why})
                continue
            t = timer.time(n, q)
            self.out["verify"].append({**row, "status": "ok", "ms": 1e3 * t,
                                       "decode_ms": 1e3 * decode_s, "ratio": t / decode_s})

    def _drafts(self, section: Section, timer: ReplayTimer, n: int, decode_s: float,
                full: int) -> None:
        before = timer.runner.captures
        pieces = self._timer(timer.cache, timer.rows)  # the alternative: per-sublayer graphs
        pieces.runner.draft_graphs = "pieces"
        for label, skip in S.skip_sets(self.cfg.num_layers).items():
            nbytes = S.step_bytes(self.cfg, 1, n, self.nbytes, skip)
            row = self._row(n, 1, skip_set=label, skipped=len(skip), bytes=nbytes)
            if (why := section.over()) is not None:
                self.out["draft"].append({**row, "status": why})
                continue
            first, t = self._first_and_replay(timer, n, 1, skip)
            self.out["draft"].append({**row, "status": "ok", "ms": 1e3 * t,
                                      "pieces_ms": 1e3 * pieces.time(n, 1, skip),
                                      "time_ratio": t / decode_s, "bytes_ratio": nbytes / full,
                                      "capture_ms": 1e3 * max(first - t, 0.0)})
        done = [r for r in self.out["draft"] if r["model"] == self.name and r["context"] == n
                and r["status"] == "ok"]
        if done:
            self.out["captures"].append({
                "model": self.name, "context": n, "status": "ok",
                "draft_captures": timer.runner.captures - before,
                "runner_captures": timer.runner.captures,
                "ms_per_capture": sum(r["capture_ms"] for r in done) / len(done)})

    def _backends(self, section: Section, cache: KVCache, rows: slice, n: int, current: str,
                  current_s: float) -> None:
        self.out["backends"].append(self._row(n, 1, backend=current, status="ok",
                                              ms=1e3 * current_s))
        for backend in BACKENDS:
            if backend == current:
                continue
            row = self._row(n, 1, backend=backend)
            if backend == "flex" and self.device.type != "cuda":
                self.out["backends"].append({**row, "status": "skipped: flex runs on CUDA only "
                                             "here (compiling it for a CPU takes minutes)"})
                continue
            if (why := section.over()) is not None:
                self.out["backends"].append({**row, "status": why})
                continue
            self.model.backend = backend
            try:
                t = self._timer(cache, rows).time(n, 1)  # a fresh runner: graphs per backend
                self.out["backends"].append({**row, "status": "ok", "ms": 1e3 * t,
                                             "vs_default": t / current_s})
            finally:
                self.model.backend = None


def run_shapes(models: dict[str, ModelConfig], device: torch.device, dtype: torch.dtype,
               plan: Plan, section: Section) -> dict[str, list]:
    out: dict[str, list] = {k: [] for k in ("decode", "verify", "draft", "backends",
                                            "captures", "notes")}
    names = list(models)
    for i, name in enumerate(names):
        part = section.part(name, 1 / (len(names) - i))
        ShapeCheck(name, models[name], device, dtype, plan, out).run(part)
    return out
