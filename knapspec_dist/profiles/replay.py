"""Sublayer costs in graph mode: whole forwards replayed with skip sets, costs by difference.

Hooks around each sublayer time an eager forward, where a sublayer's cost is mostly its
kernel launches (on an H200, Llama-3.1-8B attention "cost" 421 us and its MLP 186 us although
the MLP reads 4.2x the bytes). Decoding replays CUDA graphs, so the knapsack must be priced
the same way. A graph cannot be hooked, but the runner replays a forward with any skip set,
and skipping is the identity, so at context n:

    t(full)         = head + L * attention + L * mlp
    t(no attention) = head + L * mlp
    t(no mlp)       = head + L * attention

give the mean attention and MLP sublayer and the head (embedding, rotary, final norm,
lm_head) from three replayed forwards; verify(q) is the replayed q-token forward itself.
Each timing is ``iters`` back-to-back replays between two CUDA events (``perf_counter`` on a
CPU, where the runner's graph stand-in re-runs the forward: the same program, eagerly).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from knapspec_dist.clock import Clock
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.model.cache import KVCache


class ReplayTimer:
    """Times replayed forwards of ``model`` over ``cache`` at contexts set by the caller."""

    def __init__(self, model, cache: KVCache, rows: slice, tokens: Callable[[int], torch.Tensor],
                 iters: int = 5):
        self.model, self.cache, self.rows = model, cache, rows
        self.tokens, self.iters = tokens, iters
        self.runner = ModelRunner(model, graphs=True, max_graph_tokens=1 << 30)
        self.runner.cache = cache  # graphs are captured on the profiler's cache
        items = model.cfg.num_layers * 2
        self.no_attention = frozenset(range(0, items, 2))
        self.no_mlp = frozenset(range(1, items, 2))
        self.clock = Clock(model.device)

    def time(self, n: int, q: int, skip: frozenset[int] = frozenset()) -> float:
        """Seconds of one replayed forward of q tokens per row at context n."""
        x = self.tokens(q)
        starts = [n] * (self.rows.stop - self.rows.start)
        self.runner(x, starts, self.cache, self.rows, skip)  # capture (first time) and warm
        begin = self.clock.mark()  # CUDA events on a GPU: launches are not serialized
        for _ in range(self.iters):
            self.runner(x, starts, self.cache, self.rows, skip)
        end = self.clock.mark()
        self.clock.sync()
        return self.clock.seconds(begin, end) / self.iters

    def split(self, n: int) -> dict[str, float]:
        """Mean attention and MLP sublayer, head and whole decode step at context n."""
        layers = self.model.cfg.num_layers
        full = self.time(n, 1)
        no_attn = self.time(n, 1, self.no_attention)
        no_mlp = self.time(n, 1, self.no_mlp)
        attention = max(full - no_attn, 0.0) / layers
        mlp = max(full - no_mlp, 0.0) / layers
        head = max(full - layers * (attention + mlp), 0.0)
        return {"attention": attention, "mlp": mlp, "head": head, "total": full}
