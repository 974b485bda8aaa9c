"""The model runner: one reusable KV cache per strategy, and CUDA graphs for the forwards that
decoding repeats.

A decode step at small batch is a few hundred small kernels; launched one by one from Python
they cost 4.6-11.5x the step's memory-bound time on an H200, 2.4-3.5x the same step replayed
as a CUDA graph (docs/gpu-measurements.md). Captured once and replayed, the launches go. What
is captured, per (rows, T, skip set):

- decode (T = 1) and verify (T = 2..``max_graph_tokens``) of the full model, keeping the
  hidden states the KnapSpec selector reads (they are intermediates the forward makes anyway);
- a draft step per plan (its skip set), captured on the plan's first draft, then replayed for
  every draft token until the plan changes (``draft_graphs = "plan"``, the default). The
  alternative, ``"pieces"``: one graph per sublayer plus a prologue (embedding, rotary, block
  mask) and an epilogue (norm, lm_head) per (rows, T), replayed in order for the executed
  sublayers: any skip set without a capture, 2L + 2 replays per draft token instead of one.
  ``knapspec gpu-check`` times both (its draft table) and the capture cost of the first.

Graphs read their inputs from static buffers (tokens, ``starts`` on the device) and bake in
the cache's addresses, so the runner owns the cache and reuses it across requests: a request
asks for ``capacity`` and gets the cache it already has when that is large enough. A graph's first
use runs the forward eagerly once (warm-up: it writes the same K/V the replay then rewrites),
captures, then replays.

On a CPU there are no graphs and the runner calls the model (``graphs=False``); tests run the
same static-shape path on a CPU through ``engine.capture.EagerGraph``, which re-runs the
recorded forward on replay (fast), or ``engine.capture.EmulatedGraph``, which captures as CUDA
does: nothing runs during a capture and its outputs hold poison until the first replay.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from knapspec_dist.engine.buckets import padded_forward
from knapspec_dist.engine.capture import EagerGraph
from knapspec_dist.engine.pages import Paging
from knapspec_dist.model.attention import attention_backend, key_layout
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.decoder import Capture, Transformer
from knapspec_dist.model.forward_meta import forward_meta
from knapspec_dist.model.paged_cache import PagedKVCache
from knapspec_dist.model.transfer import upload

log = logging.getLogger(__name__)

MIN_CAPACITY = 256
CAPACITY_STEP = 256  # capacities round up to this (two flex key blocks), not to powers of two


class CudaGraph:
    """One captured forward: warm-up on a side stream, capture into a shared pool, replay."""

    def __init__(self, fn: Callable[[], object], pool):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up: compiles kernels, allocates workspaces; same writes as the replay
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()

    def replay(self) -> None:
        self.graph.replay()


class ModelRunner:
    """Forwards of one model over its reusable cache: eager, or replayed CUDA graphs."""

    def __init__(self, model: Transformer, graphs: bool | None = None, *,
                 graph_factory: Callable | None = None, max_graph_tokens: int = 17,
                 max_graphs: int = 256):
        self.model = model
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        self.max_graph_tokens, self.max_graphs = max_graph_tokens, max_graphs
        self.cache: KVCache | None = None
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self._pool = None
        if graph_factory is not None:
            self._factory = graph_factory
        elif self.graphs and model.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
            self._factory = lambda fn: CudaGraph(fn, self._pool)
        else:
            self._factory = EagerGraph
        # Stop drafting once every row has an unsure draft (speculation/selfspec.py): one read-back
        # per draft token, microseconds against a millisecond-scale step. False: all gamma are
        # drafted with no host wait (``knapspec gpu-check`` times both).
        self.early_exit = True
        self.captures = 0  # graphs captured so far (stats, gpu-check)
        # "plan" (the default) or "pieces" (see the module docstring). Only gpu-check (its
        # ``pieces`` table, tools/gpucheck/late.py) and tests set "pieces": it stays while the
        # A/B of the two on a GPU is still to be read; no strategy or command chooses it.
        self.draft_graphs = "plan"
        self._piece_sets: dict[tuple, tuple] = {}
        self.aliases: PagedKVCache | None = None  # the ragged verify's rows (``ragged``)

    def new_cache(self, batch: int, capacity: int, kv_heads: int,
                  paging: Paging | None = None) -> KVCache | PagedKVCache:
        """A cache of at least ``capacity`` positions and ``batch`` rows, every row empty; the
        same one as last time when it fits (graphs captured on it stay valid). ``paging``: a
        paged cache of that pool, rows of up to ``capacity`` positions; None: fixed slots."""
        c = self.cache
        size = -(-max(capacity, MIN_CAPACITY) // CAPACITY_STEP) * CAPACITY_STEP
        if paging is not None:
            layout = key_layout(attention_backend(self.model), paging.page)
            fits = (isinstance(c, PagedKVCache) and c.batch >= batch and c.capacity >= capacity
                    and c.kv_heads == kv_heads and (c.n_pages, c.page) == (paging.n_pages,
                                                                            paging.page)
                    and c.key_layout == layout)
            if not fits:
                c = PagedKVCache(self.model.cfg, batch, size, paging.n_pages, paging.page,
                                 dtype=self.model.dtype, device=self.model.device,
                                 kv_heads=kv_heads, key_layout=layout)
        elif (not isinstance(c, KVCache) or c.batch < batch or c.capacity < capacity
              or c.k[0].shape[1] != kv_heads):
            c = KVCache(self.model.cfg, batch, size, dtype=self.model.dtype,
                        device=self.model.device, kv_heads=kv_heads)
        if c is not self.cache:
            self.cache, self.aliases = c, None
            self._graphs.clear()
            self._piece_sets.clear()
        self.empty_cache()
        return c

    def empty_cache(self) -> None:
        """Every row of the cache empty (a paged cache's pages all unassigned): what a new
        scheduler starts from, and what a failed one leaves behind it."""
        c = self.cache
        for row in range(c.batch if c is not None else 0):
            if isinstance(c, PagedKVCache):
                c.release(row)
            else:
                c.commit(row, 0)

    def __call__(self, tokens: torch.Tensor, starts: Sequence[int], cache: KVCache,
                 rows: slice | None = None, skip: frozenset[int] = frozenset(),
                 last_only: bool = False, capture: Capture | None = None,
                 starts_dev: torch.Tensor | None = None) -> torch.Tensor:
        """``Transformer.forward``, replayed from a graph where one applies; under flex, over
        the batch padded to its bucket (engine/buckets.py). ``starts_dev``: ``starts`` already
        on the device (the round's one upload); else they are uploaded (a padded batch's
        starts are, once per forward)."""
        if attention_backend(self.model) == "flex":
            out = padded_forward(self, tokens, starts, cache, rows, capture, skip=skip,
                                 last_only=last_only)
            if out is not None:
                return out
        t = tokens.shape[1]
        owned = cache is self.cache or (cache is self.aliases and cache is not None)
        if (not self.graphs or not owned or last_only or t > self.max_graph_tokens
                or min(starts) == 0):  # prefills stay eager: one per request, long, varied
            return self.model(tokens, starts, cache, rows, skip, last_only, capture, starts_dev)
        rows = rows if rows is not None else slice(0, tokens.shape[0])
        if starts_dev is None:
            starts_dev = upload(list(starts), self.model.device)
        if skip and self.draft_graphs == "pieces" and capture is None:
            return self._pieces(tokens, starts_dev, cache, rows, skip)
        key = (rows.start, rows.stop, t, skip, self.model.backend, cache is self.aliases)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, tokens, starts_dev, cache, rows, skip)
        else:
            self._graphs.move_to_end(key)
        static_tokens, static_starts, graph, states = entry
        static_tokens.copy_(tokens)
        static_starts.copy_(starts_dev)
        graph.replay()
        logits, hidden = graph.output
        if capture is not None:
            capture.extend(states)
        return logits

    def ragged(self, tokens: torch.Tensor, starts: Sequence[int], cache: PagedKVCache,
               index: Sequence[int], capture: Capture | None = None,
               starts_dev: torch.Tensor | None = None) -> torch.Tensor:
        """One forward of ``tokens`` [N, 1]: token i at position ``starts[i]`` of cache row
        ``index[i]``; logits [N, 1, V]. A row's tokens go in position order, each a row of
        its own over the row's pages (``PagedKVCache.alias``): every layer writes all N
        tokens' K/V before attention reads them, so token i sees its row's earlier tokens of
        the same forward, as in a forward of the row's tokens together. Rows verifying
        different numbers of tokens then cost the tokens they verify, none of padding
        (engine/ragged.py). Replayed from graphs as any forward: the alias rows are the
        runner's, their table changed in place; their count grows by powers of two."""
        n = len(index)
        aliases = self.aliases if cache is self.cache else cache.aliases(n)  # else eager
        if aliases is None or aliases.batch < n:
            size = 1 << max(n - 1, 0).bit_length()
            aliases = self.aliases = cache.aliases(max(size, cache.batch))
            for key in [k for k in self._graphs if k[-1]]:
                del self._graphs[key]  # captured over the smaller alias table
        aliases.alias(cache, index)
        return self(tokens, starts, aliases, slice(0, n), capture=capture,
                    starts_dev=starts_dev)

    def _capture(self, key, tokens, starts_dev, cache, rows, skip):
        static_tokens, static_starts = tokens.clone(), starts_dev.clone()
        states = Capture()

        def forward():
            states.clear()
            logits = self.model(static_tokens, static_starts, cache, rows, skip, capture=states)
            return logits, list(states)

        graph = self._factory(forward)
        self.captures += 1
        entry = (static_tokens, static_starts, graph, graph.output[1])
        self._graphs[key] = entry
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        log.debug("captured a graph for rows %s..%s, %d tokens, %d skipped sublayers",
                  key[0], key[1], key[2], len(skip))
        return entry

    def _pieces(self, tokens, starts_dev, cache: KVCache, rows: slice, skip: frozenset[int]):
        """A draft step replayed from per-sublayer graphs: the prologue, the executed
        sublayers in order, the epilogue; all share one static hidden-state buffer."""
        key = (rows.start, rows.stop, tokens.shape[1], self.model.backend, cache is self.aliases)
        entry = self._piece_sets.get(key)
        if entry is None:
            entry = self._capture_pieces(tokens, starts_dev, cache, rows)
            self._piece_sets[key] = entry
        static_tokens, static_starts, prologue, items, epilogue = entry
        static_tokens.copy_(tokens)
        static_starts.copy_(starts_dev)
        prologue.replay()
        for i, piece in enumerate(items):
            if i not in skip:
                piece.replay()
        epilogue.replay()
        return epilogue.output

    def _capture_pieces(self, tokens, starts_dev, cache: KVCache, rows: slice):
        model = self.model
        static_tokens, static_starts = tokens.clone(), starts_dev.clone()
        shared: dict = {}

        def prologue():
            shared["meta"] = forward_meta(model, static_starts, static_tokens.shape[1], cache, rows)
            h = model.embed(static_tokens)
            if "h" not in shared:
                shared["h"] = h
            else:
                shared["h"].copy_(h)
            return shared["h"]

        def piece(i: int):
            layer = model.layers[i // 2]

            def run():
                h = shared["h"]
                out = layer.attention(h, shared["meta"], cache, i // 2) if i % 2 == 0 \
                    else layer.mlp(h)
                h.copy_(out)
                return h
            return run

        first = self._factory(prologue)
        # A capture runs nothing: the forward meta's tensors and h hold garbage until the prologue
        # is replayed, and each piece's warm-up reads them (out-of-range cache writes otherwise).
        first.replay()
        items = [self._factory(piece(i)) for i in range(model.cfg.num_items)]
        last = self._factory(lambda: model.logits(shared["h"]))
        self.captures += len(items) + 2
        return static_tokens, static_starts, first, items, last


def prefill(model: Transformer, cache, row: int, tokens: list[int], start: int = 0,
            capture=None) -> torch.Tensor:
    """Run ``tokens`` into cache row ``row`` from position ``start`` (padding-free) and commit
    them; the last position's logits [V]. ``capture`` (model.Capture) gets the hidden states."""
    with torch.inference_mode():
        logits = model(upload([tokens], model.device), [start], cache,
                       slice(row, row + 1), last_only=True, capture=capture)
    cache.commit(row, start + len(tokens))
    return logits[0, -1]
