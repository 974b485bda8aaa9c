"""The collectives of one TP rank, counted and timed (what the accounting splits as comm_s)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from knapspec_dist.clock import Clock


@dataclass
class Comm:
    """The collectives of one rank, timed: ``seconds`` is wall time spent inside them.

    On CUDA the collectives are asynchronous; ``timed`` then synchronizes around each one
    (accurate but slower), otherwise only calls are counted.
    """

    group: object
    rank: int
    world: int
    timed: bool = True
    cuda: bool = False
    seconds: float = 0.0
    calls: int = 0

    @property
    def device(self) -> torch.device:
        """Where the collectives' tensors live: NCCL's on the GPU, gloo's on the CPU."""
        return torch.device("cuda", torch.cuda.current_device()) if self.cuda \
            else torch.device("cpu")

    def _clock(self) -> float:
        return Clock("cuda" if self.cuda else "cpu").now()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = self._clock() if self.timed else 0.0
        dist.all_reduce(x, group=self.group)
        if self.timed:
            self.seconds += self._clock() - t0
        self.calls += 1
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim (rank order)."""
        t0 = self._clock() if self.timed else 0.0
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        out = torch.cat(parts, dim=-1)
        if self.timed:
            self.seconds += self._clock() - t0
        self.calls += 1
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        t0 = self._clock() if self.timed else 0.0
        dist.broadcast(x, src=src, group=self.group)
        if self.timed:
            self.seconds += self._clock() - t0
        self.calls += 1
        return x

    def reset(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out
