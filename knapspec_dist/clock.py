"""The one clock of the engine: wall time that means what it says on a GPU.

On a CPU, ops run synchronously and ``time.perf_counter`` is the truth. On CUDA, kernels are
queued asynchronously, so a host timestamp only measures launches unless the stream is
synchronized first. :class:`Clock` has both ways of timing:

* ``now()``: synchronize (on CUDA), then ``perf_counter``. For sections whose end is a host
  decision anyway (prefill, a draft round, a collective, a verify forward).
* ``mark()`` / ``seconds(a, b)``: CUDA events recorded on the stream (``perf_counter`` on a
  CPU), read after one ``sync()`` at the end; they time back-to-back work without
  serializing the launches they measure (the profiler's per-sublayer hooks).

Used by the scheduler and the strategies' timers (engine/, speculation/), the timed collectives
(parallel/comm.py) and the latency profiler (profiles/profiler.py).
"""

from __future__ import annotations

import time

import torch


class Clock:
    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def now(self) -> float:
        """Seconds (perf_counter) after the device finished everything queued so far."""
        self.sync()
        return time.perf_counter()

    def mark(self):
        """A time mark: a recorded CUDA event on a GPU, perf_counter on a CPU."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        """Seconds between two marks (after ``sync()`` on a GPU)."""
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a
