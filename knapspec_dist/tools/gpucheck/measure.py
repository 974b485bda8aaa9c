"""Timed forwards of random-weight shapes: decode against the memory bound, verify(q) /
decode, draft against bytes skipped and graph capture cost (the attention backend A/B and
the per-sublayer draft graphs, the riskiest parts, are late.py's, run last).

Each timing is ReplayTimer's: the forward captured once (a CUDA graph; on a CPU the runner's
eager stand-in), then ``iters`` replays between two CUDA events. The cache of each
measurement holds just the context (rounded up to 256 positions): with device-side lengths
an sdpa graph reads all ``capacity`` keys, so a larger cache would time a longer context.
Before a cache is allocated its bytes are compared with the device's free memory; a row
that would not fit says so. Every row is measured through ``Rows.add``: an exception (out
of memory included) becomes that row's status, and the rows that need it are skipped.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from knapspec_dist.model.attention import attention_backend
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.config import ModelConfig
from knapspec_dist.model.decoder import Transformer, rope_frequencies
from knapspec_dist.profiles.profiler import fill_cache
from knapspec_dist.profiles.replay import ReplayTimer
from knapspec_dist.tools.gpucheck import shapes as S
from knapspec_dist.tools.gpucheck.budget import Section
from knapspec_dist.tools.gpucheck.rows import Rows

log = logging.getLogger(__name__)


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
    """Hand a finished shape's memory back to the device (a collection finds what cycles
    hold). Not on a CPU: there a collection costs about a second of a --quick run each."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gib(n: int) -> str:
    return f"{n / S.GIB:.1f} GiB"


class ShapeCheck:
    """One model shape built on the device, and its measurements for one section; rows go to
    the document's tables (``out``) through ``rows``."""

    def __init__(self, name: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 plan: Plan, out: dict, rows: Rows):
        self.name, self.cfg, self.device, self.dtype, self.plan = name, cfg, device, dtype, plan
        self.out, self.rows = out, rows
        self.nbytes = torch.empty((), dtype=dtype).element_size()
        self.model: Transformer | None = None
        # Seconds of the last first call (compile, capture, one replay): what the next new
        # shape is expected to cost before it measures anything (the budget's need_s).
        self.first_s = 0.0

    def run(self, section: Section, measure: Callable[["ShapeCheck", Section], None]) -> None:
        """Build the model when it fits in memory and in the budget, then ``measure`` it."""
        resident = S.resident_bytes(self.cfg, self.nbytes)
        free = free_bytes(self.device, self.plan.memory_limit)
        if resident > free:
            self.note(f"{self.name}: weights need {_gib(resident)}, {_gib(free)} free: skipped")
            return
        if (why := section.over()) is not None:
            self.note(f"{self.name}: {why}")
            return
        start = time.perf_counter()
        self.model = self.rows.attempt(self.out["notes"], f"{self.name}: building the model",
                                       lambda: build_random(self.cfg, self.device, self.dtype))
        if self.model is None:
            return
        log.info("%s: built in %.1f s (%s resident)", self.name, time.perf_counter() - start,
                 _gib(resident))
        try:
            measure(self, section)
        finally:
            self.model = None
            release(self.device)

    def note(self, text: str) -> None:
        log.warning("%s", text)
        self.out["notes"].append(text)

    def row(self, n: int, b: int, **extra) -> dict:
        return {"model": self.name, "context": n, "batch": b, **extra}

    @staticmethod
    def capacity(n: int, plan: Plan) -> int:
        return -(-(n + max(plan.qs) + 1) // 256) * 256

    def fit(self, n: int, b: int) -> str | None:
        """Why a cache of context n x b rows (and its activations) would not fit, or None."""
        need = S.memory_need(self.cfg, b, self.capacity(n, self.plan), self.nbytes,
                             max(self.plan.qs)) - S.resident_bytes(self.cfg, self.nbytes)
        free = free_bytes(self.device, self.plan.memory_limit)
        if need > free:
            return f"does not fit: cache and activations need {_gib(need)}, {_gib(free)} free"
        return None

    def cache(self, n: int, b: int) -> KVCache:
        """A cache of b rows holding just context n (rounded up to 256 positions), filled."""
        cache = KVCache(self.cfg, b, self.capacity(n, self.plan), dtype=self.dtype,
                        device=self.device)
        fill_cache(self.model, cache, n)
        return cache

    def timer(self, cache: KVCache, rows: slice) -> ReplayTimer:
        vocab, b = self.cfg.vocab_size, rows.stop - rows.start
        return ReplayTimer(self.model, cache, rows,
                           lambda q: torch.randint(vocab, (b, q), device=self.device),
                           iters=self.plan.iters)

    def first_and_replay(self, timer: ReplayTimer, n: int, q: int,
                         skip: frozenset[int] = frozenset()) -> tuple[float, float]:
        """Seconds of the first call (warm-up forward, compile, capture, one replay: what a new
        plan's first draft pays) and of a replay; their difference is the capture cost."""
        b = timer.rows.stop - timer.rows.start
        x = timer.tokens(q)
        _sync(self.device)
        start = time.perf_counter()
        timer.runner(x, [n] * b, timer.cache, timer.rows, skip)
        _sync(self.device)
        first = time.perf_counter() - start
        self.first_s = first
        return first, timer.time(n, q, skip)

    def main(self, section: Section) -> None:
        """Decode at every context and batch; verify and plan-graph drafts at batch 1."""
        for n in self.plan.contexts:
            for b in self.plan.batches:
                self._context(section, n, b)

    def _context(self, section: Section, n: int, b: int) -> None:
        full = S.step_bytes(self.cfg, b, n, self.nbytes)
        row = self.row(n, b, bytes=full, bound_ms=1e3 * S.bound_s(full, self.plan.bandwidth))
        if (why := self.fit(n, b)) is not None:
            self.rows.skip(self.out["decode"], row, why)
            return
        live: dict = {}

        def decode() -> dict:
            live["timer"] = timer = self.timer(self.cache(n, b), slice(0, b))
            first, t = self.first_and_replay(timer, n, 1)
            live["t"] = t
            return {"backend": attention_backend(self.model),
                    "ms": 1e3 * t, "ratio": t / (row["bound_ms"] / 1e3),
                    "tb_per_s": full / t / 1e12, "first_call_ms": 1e3 * first}

        try:
            if self.rows.add(self.out["decode"], row, decode, section, self.first_s) and b == 1:
                self._verify(section, live["timer"], n, live["t"])
                self._drafts(section, live["timer"], n, live["t"], full)
        finally:
            live.clear()
            release(self.device)

    def _verify(self, section: Section, timer: ReplayTimer, n: int, decode_s: float) -> None:
        for q in self.plan.qs:
            def verify(q=q) -> dict:
                t = timer.time(n, q)
                return {"ms": 1e3 * t, "decode_ms": 1e3 * decode_s, "ratio": t / decode_s}
            self.rows.add(self.out["verify"], self.row(n, 1, q=q), verify, section,
                          self.first_s)  # each q is a new graph: a capture first

    def _drafts(self, section: Section, timer: ReplayTimer, n: int, decode_s: float,
                full: int) -> None:
        before = timer.runner.captures
        done = []
        for label, skip in S.skip_sets(self.cfg.num_layers).items():
            nbytes = S.step_bytes(self.cfg, 1, n, self.nbytes, skip)

            def draft(skip=skip, nbytes=nbytes) -> dict:
                first, t = self.first_and_replay(timer, n, 1, skip)
                return {"ms": 1e3 * t, "time_ratio": t / decode_s, "bytes_ratio": nbytes / full,
                        "capture_ms": 1e3 * max(first - t, 0.0)}
            row = self.rows.add(self.out["draft"], self.row(n, 1, skip_set=label,
                                                            skipped=len(skip), bytes=nbytes),
                                draft, section, self.first_s)
            if row is not None:
                done.append(row)
        if done:
            self.rows.add(self.out["captures"], {"model": self.name, "context": n}, lambda: {
                "draft_captures": timer.runner.captures - before,
                "runner_captures": timer.runner.captures,
                "ms_per_capture": sum(r["capture_ms"] for r in done) / len(done)})


def run_shapes(models: dict[str, ModelConfig], device: torch.device, dtype: torch.dtype,
               plan: Plan, section: Section, out: dict, rows: Rows,
               measure: Callable[[ShapeCheck, Section], None] = ShapeCheck.main) -> None:
    """``measure`` on every shape in turn, each in its share of what is left of ``section``;
    the rows land in ``out``'s tables (the gpu-check document)."""
    names = list(models)
    for i, name in enumerate(names):
        part = section.part(name, 1 / (len(names) - i))
        ShapeCheck(name, models[name], device, dtype, plan, out, rows).run(part, measure)
