"""Latency profiler: measure sublayer, head, verify and all-reduce costs on the real device.

``measure`` times the model the way decoding runs it, and hands the raw samples to
``fit_profile`` (profile.py); ``knapspec profile`` (command.py) is its command line. A
profile is only ever written from such a measurement.

Method
------
One KV cache of ``batch`` rows of capacity ``max(contexts) + max_q`` is filled once (random K/V
by default;
``fill="prefill"`` runs a real chunked prefill of random tokens instead, which costs minutes
at 8k on a CPU and changes no timing: attention reads the same number of cached values
whatever they are). A context length n is then just ``cache.lengths = n``; forwards at n
write at positions n.. and are never committed, so every repeat sees the same n. With
``kv="paged"`` it is a ``PagedKVCache`` (model/paged_cache.py) whose rows hold the pages the
block manager gives them (engine/pages.py: on a pool just large enough, one run of
consecutive pages each, read in place on a CPU), so the attention measured is the paged one.
The cache must fit in the memory left beside the weights (engine/memory.py's rule): a large
batch at long contexts that does not is refused with the longest context that would fit,
since every row holds the longest context measured.

For each repeat, round-robin over the contexts (so a burst of load from elsewhere spreads
over all contexts instead of spoiling one), at each n:

* **Sublayers and head** — one decode-shaped forward (``[batch, 1]`` tokens at position n)
  through ``model.forward`` itself, over all layers in turn, so each sublayer runs with the
  caches in the state real decoding leaves them (the previous sublayer's weights, not its
  own, are hot). Forward pre/post hooks on every ``Attention`` and ``MLP`` module put time
  marks around each sublayer call: ``time.perf_counter`` on a CPU (ops run synchronously
  there), CUDA events on a GPU (recorded on the stream, read after one synchronize at the
  end, so the timing does not serialize the launches it measures). A sublayer's time
  includes its all-reduce when the model is tensor-parallel (``reduce`` runs inside it).
  The attention and MLP sample of that forward are the mean over the L layers; the head
  sample is everything of the forward outside the 2L sublayers: embedding, rotary / mask
  setup, final norm and lm_head -- the per-forward cost a draft step pays whichever
  sublayers it skips, so ``draft_time(skipped=(), n)`` is the whole decode step.
* **Verify** — for q = 1..max_q, one full forward of q tokens at positions n..n+q-1,
  without hooks, timed as a whole (synchronized on a GPU): the cost of verifying q - 1
  drafted tokens plus the bonus one. q = 1 is a plain decode step, which cross-checks the
  hooked sum above.

Every shape is run ``warmup`` times first (allocator, oneDNN / cuBLAS kernel choice); the
stored sample of each (kind, n[, q]) is the median of ``repeats`` timings, and
``samples["spread"]`` records each point's relative spread ``(max - min) / median`` of those
timings (MAX over the ranks under TP): repeats that disagree mean the machine was busy, and
profiles/store.py then uses the profile for the run but does not cache it (``SPREAD_LIMIT``).
With a process group of more than one rank (tensor parallelism) every rank measures,
samples are reduced with MAX (a replica runs at its slowest rank's pace), and
``measure_allreduce`` (allreduce.py) adds the all-reduce cost at the message sizes decoding
uses.

Other processes on the machine distort every number (on a 2-core CPU with two OpenMP threads,
a load average of 10 made decode steps ~20x slower), so the 1-minute load average before and
after is stored in ``device["load_average"]`` and a busy CPU is warned about (``device.cpu_busy``:
the measuring threads' own load is not counted against it).
"""

from __future__ import annotations

import datetime
import logging
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from knapspec_dist.clock import Clock
from knapspec_dist.engine.memory import free_bytes, kv_bytes_per_token, positions_that_fit
from knapspec_dist.engine.pages import PagePool, page_size
from knapspec_dist.errors import UserError
from knapspec_dist.model.attention import attention_backend, key_layout
from knapspec_dist.model.cache import KVCache, kv_heads
from knapspec_dist.model.paged_cache import PagedKVCache
from knapspec_dist.model.weights import dtype_name
from knapspec_dist.profiles.allreduce import (
    decode_allreduce_sizes,
    max_over_ranks,
    measure_allreduce,
    world_size,
)
from knapspec_dist.profiles.device import cpu_busy, device_info
from knapspec_dist.profiles.profile import KV_LAYOUTS, MODES, LatencyProfile, fit_profile
from knapspec_dist.profiles.replay import ReplayTimer

log = logging.getLogger(__name__)

DEFAULT_CONTEXTS = (256, 512, 1024, 2048, 4096, 8192)
DEFAULT_MAX_Q = 11  # D + 1: ten drafted tokens and the target's own


# --------------------------------------------------------------------------- timing


class _SublayerTimer:
    """Forward hooks marking the start and end of every Attention / MLP call and of the forward."""

    def __init__(self, model, clock: Clock):
        self.clock = clock
        self.marks: list[tuple[str, str, Any]] = []  # (kind, "start"|"end", mark)
        self.handles = []
        for layer in model.layers:
            for kind, module in (("attention", layer.attention), ("mlp", layer.mlp)):
                self.handles.append(module.register_forward_pre_hook(self._pre(kind)))
                self.handles.append(module.register_forward_hook(self._post(kind)))
        self.handles.append(model.register_forward_pre_hook(self._pre("forward")))
        self.handles.append(model.register_forward_hook(self._post("forward")))

    def _pre(self, kind: str):
        def hook(module, args):
            self.marks.append((kind, "start", self.clock.mark()))
        return hook

    def _post(self, kind: str):
        def hook(module, args, output):
            self.marks.append((kind, "end", self.clock.mark()))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def split(self) -> dict[str, list[float]]:
        """Durations of the last forward: per-sublayer lists, and the head.

        The head is the forward's time minus its sublayers'.
        """
        self.clock.sync()
        marks, self.marks = self.marks, []
        if not marks or marks[0][0] != "forward" or marks[-1][0] != "forward":
            raise RuntimeError("sublayer timer saw no complete forward")
        out: dict[str, list[float]] = {"attention": [], "mlp": []}
        for (kind, edge, a), (kind2, edge2, b) in zip(marks[1:-1:2], marks[2:-1:2]):
            if kind != kind2 or edge != "start" or edge2 != "end":
                raise RuntimeError(f"unbalanced sublayer marks: {kind}/{edge} then {kind2}/{edge2}")
            out[kind].append(self.clock.seconds(a, b))
        total = self.clock.seconds(marks[0][2], marks[-1][2])
        # Head: forward start -> first sublayer, last sublayer -> forward end (hook gaps between
        # sublayers are the timer's own overhead and are left out).
        first, last = marks[1][2], marks[-2][2]
        inside = self.clock.seconds(first, last)
        out["head"] = [max(0.0, total - inside)]
        out["total"] = [total]
        return out


# --------------------------------------------------------------------------- measurement


def fill_cache(model, cache, length: int, fill: str = "random", chunk: int = 512,
               generator: torch.Generator | None = None) -> None:
    """Make the first ``length`` positions of every row valid.

    ``random``: write random K/V directly (instant; attention cost does not depend on values).
    ``prefill``: run random tokens through the model in chunks, as a real prompt would.
    """
    if fill == "random":
        for layer in range(len(cache.k)):
            for t in (cache.k[layer], cache.v[layer]):
                # a paged pool [positions, kv, hd] is filled whole: every row's pages are in it
                part = t if isinstance(cache, PagedKVCache) else t[:, :, :length]
                part.normal_(generator=generator if t.device.type == "cpu" else None)
    elif fill == "prefill":
        vocab = model.cfg.vocab_size
        for row in range(cache.batch):
            cache.commit(row, 0)
        rows = slice(0, cache.batch)
        done = 0
        while done < length:
            t = min(chunk, length - done)
            tokens = torch.randint(vocab, (cache.batch, t), generator=generator).to(model.device)
            model(tokens, cache.lengths[rows], cache, rows, last_only=True)
            done += t
            for row in range(cache.batch):
                cache.commit(row, done)
    else:
        raise ValueError(f"unknown cache fill {fill!r}; choose random or prefill")
    for row in range(cache.batch):
        cache.commit(row, length)


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


class _Sampler:
    """Timed forwards of ``model`` over one filled cache, at any context n it holds: hooked
    (sublayers and head) or replayed (graph mode), and whole verify forwards of q tokens."""

    def __init__(self, model, cache: KVCache, batch: int, mode: str, gen: torch.Generator):
        self.model, self.cache, self.gen = model, cache, gen
        self.rows = slice(0, batch)
        self.clock = Clock(model.device)
        self.replay = ReplayTimer(model, cache, self.rows, self.tokens) if mode == "graph" else None

    def tokens(self, q: int) -> torch.Tensor:
        batch = self.rows.stop
        return torch.randint(self.model.cfg.vocab_size, (batch, q),
                             generator=self.gen).to(self.model.device)

    def at(self, n: int) -> None:
        """Context n for every row: forwards write at n.. and are never committed."""
        for row in range(self.rows.stop):
            self.cache.commit(row, n)

    def step(self, n: int) -> dict[str, list[float]]:
        """One decode step at n, split into sublayers, head and total."""
        self.at(n)
        if self.replay is not None:
            layers = self.model.cfg.num_layers
            return {k: [v] * (layers if k in ("attention", "mlp") else 1)
                    for k, v in self.replay.split(n).items()}
        timer = _SublayerTimer(self.model, self.clock)
        try:
            self.model(self.tokens(1), self.cache.lengths[self.rows], self.cache, self.rows)
        finally:
            timer.remove()
        return timer.split()

    def verify(self, n: int, q: int) -> float:
        """One unhooked forward of q tokens at n."""
        self.at(n)
        if self.replay is not None:
            return self.replay.time(n, q)
        x, pos = self.tokens(q), self.cache.lengths[self.rows]
        start = self.clock.now()
        self.model(x, pos, self.cache, self.rows)
        return self.clock.now() - start


def _check(mode: str, contexts: Sequence[int], batch: int, max_q: int, repeats: int,
           warmup: int, kv: str = "fixed") -> list[int]:
    """The sorted distinct contexts; ValueError for anything that cannot be measured."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if kv not in KV_LAYOUTS:
        raise ValueError(f"kv must be one of {', '.join(KV_LAYOUTS)}, got {kv!r}")
    contexts = sorted(set(int(n) for n in contexts))
    if not contexts or contexts[0] < 1:
        raise ValueError(f"contexts must be positive integers, got {contexts}")
    if batch < 1 or max_q < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need batch, max_q, repeats >= 1 and warmup >= 0 "
                         f"(got {batch}, {max_q}, {repeats}, {warmup})")
    return contexts


def profile_cache(model, batch: int, capacity: int, kv: str = "fixed", page: int | None = None
                  ) -> KVCache | PagedKVCache:
    """The cache the profiler measures over: ``batch`` rows of ``capacity`` positions, fixed
    slots or pages as the block manager hands them out (``kv="paged"``); a UserError, naming the
    longest context that would fit, where the memory beside the weights cannot hold it."""
    per_token = kv_bytes_per_token(model)
    free = free_bytes(model.device)
    if positions_that_fit(free, per_token) < batch * capacity:
        longest = positions_that_fit(free, per_token) // batch
        raise UserError(f"a profile at batch {batch} with contexts up to {capacity} positions "
                        f"needs {batch * capacity * per_token / 1e9:.2f} GB of KV cache "
                        f"({per_token} bytes a position); the free memory holds "
                        f"{longest} positions a row at this batch: measure shorter --contexts")
    cfg, heads = model.cfg, kv_heads(model)
    if kv == "fixed":
        return KVCache(cfg, batch, capacity, dtype=model.dtype, device=model.device,
                       kv_heads=heads)
    page = page or page_size(attention_backend(model))
    blocks = -(-capacity // page)
    cache = PagedKVCache(cfg, batch, capacity, batch * blocks + 1, page, dtype=model.dtype,
                         device=model.device, kv_heads=heads,
                         key_layout=key_layout(attention_backend(model), page))
    pool = PagePool(cache)
    for row in range(batch):
        pool.admit(row, capacity)
    return cache


def _timings(sampler: _Sampler, contexts: list[int], qs: list[int], warmup: int, repeats: int,
             started: float) -> dict[str, dict]:
    """Every timing of every repeat, round-robin over the contexts: per context n the
    attention, mlp, head and total of each hooked step, and per (q, n) each verify."""
    raw: dict[str, dict] = {k: {n: [] for n in contexts}
                            for k in ("attention", "mlp", "head", "total")}
    raw["verify"] = {(q, n): [] for n in contexts for q in qs}
    try:
        for _ in range(warmup):
            for n in contexts:
                sampler.step(n)
                for q in qs:
                    sampler.verify(n, q)
        for r in range(repeats):
            for n in contexts:
                parts = sampler.step(n)
                raw["attention"][n].append(statistics.fmean(parts["attention"]))
                raw["mlp"][n].append(statistics.fmean(parts["mlp"]))
                raw["head"][n].append(parts["head"][0])
                raw["total"][n].append(parts["total"][0])
                for q in qs:
                    raw["verify"][(q, n)].append(sampler.verify(n, q))
            log.info("repeat %d/%d done (%.0fs)", r + 1, repeats, time.perf_counter() - started)
    finally:
        sampler.at(0)
    return raw


def relative_spread(timings: Sequence[float]) -> float:
    """``(max - min) / median`` of one point's repeated timings (0 for one timing, or when
    the median is 0)."""
    med = _median(timings)
    return float((max(timings) - min(timings)) / med) if med > 0 else 0.0


def _samples(raw: dict[str, dict], contexts: list[int], qs: list[int], tp: int,
             group) -> dict[str, Any]:
    """``fit_profile``'s samples: the median of each point's timings, MAX over the ranks of
    a tensor-parallel group; ``spread``: each point's relative spread (MAX over the ranks)."""
    ver_keys = [(q, n) for n in contexts for q in qs]
    series = [raw["attention"][n] for n in contexts] + [raw["mlp"][n] for n in contexts] \
        + [raw["head"][n] for n in contexts] + [raw["verify"][k] for k in ver_keys]
    values = [_median(t) for t in series]
    spreads = [relative_spread(t) for t in series]
    if tp > 1:
        merged = max_over_ranks(values + spreads, group)
        values, spreads = merged[:len(series)], merged[len(series):]
    k = len(contexts)

    def split(xs):
        return xs[:k], xs[k:2 * k], xs[2 * k:3 * k], xs[3 * k:]
    attn_s, mlp_s, head_s, ver_s = split(values)
    attn_d, mlp_d, head_d, ver_d = split(spreads)
    return {
        "attention": [[n, s] for n, s in zip(contexts, attn_s)],
        "mlp": mlp_s,
        "head": head_s,
        "verify": [[q, n, s] for (q, n), s in zip(ver_keys, ver_s)],
        "spread": {"attention": [[n, d] for n, d in zip(contexts, attn_d)],
                   "mlp": [[n, d] for n, d in zip(contexts, mlp_d)],
                   "head": [[n, d] for n, d in zip(contexts, head_d)],
                   "verify": [[q, n, d] for (q, n), d in zip(ver_keys, ver_d)]},
    }


def _log_cross_check(raw: dict[str, dict], contexts: list[int]) -> None:
    """Per context: the hooked decode step vs the unhooked q=1 verify forward."""
    for n in contexts:
        log.info("n=%d: attention %.3f ms, mlp %.3f ms, head %.3f ms; hooked step %.2f ms, "
                 "plain step %.2f ms", n, 1e3 * _median(raw["attention"][n]),
                 1e3 * _median(raw["mlp"][n]), 1e3 * _median(raw["head"][n]),
                 1e3 * _median(raw["total"][n]), 1e3 * _median(raw["verify"][(1, n)]))


def _device_record(device: torch.device, load_before: float | None) -> dict[str, Any]:
    """``device_info`` with the 1-minute load average before and after measuring; a busy CPU
    (``device.cpu_busy``) is warned about."""
    info = device_info(device)
    load = [load_before, _load_average()]
    if None not in load:
        info["load_average"] = load
        busy = cpu_busy(info)
        if busy:
            log.warning("the machine was busy while measuring: %s; timings include contention "
                        "from other processes; re-run on an idle machine", busy)
    return info


@torch.inference_mode()
def measure(model, contexts: Sequence[int], batch: int = 1, max_q: int = DEFAULT_MAX_Q,
            repeats: int = 5, *, warmup: int = 1, fill: str = "random", group=None,
            shape: dict[str, Any] | None = None, allreduce_sizes: Sequence[int] | None = None,
            seed: int = 0, mode: str = "eager", kv: str = "fixed",
            page: int | None = None) -> LatencyProfile:
    """Measure ``model`` (a loaded ``Transformer``) and fit its latency profile.

    contexts: context lengths n (tokens already in the KV cache); batch: sequences per forward;
    max_q: verify forwards are timed for q = 1..max_q tokens; repeats: timings per point (the
    sample is their median); warmup: untimed runs of every shape first; fill: how the cache is
    filled (see ``fill_cache``); group: the tensor-parallel process group when the model is a
    shard (tp = its size; samples are MAX-reduced over ranks and all-reduce samples added);
    shape: the model shape to record (defaults to ``model.cfg.shape()``; a TP shard passes the
    full model's); mode: "eager" (hooked sublayers) or "graph" (replayed forwards, the way
    decoding runs on a GPU; see replay.py); kv: "fixed" slots or "paged" (pages of ``page``
    positions, by default the backend's: engine/pages.py's ``page_size``). See the module
    docstring for the method.
    """
    contexts = _check(mode, contexts, batch, max_q, repeats, warmup, kv)
    device, dtype, cfg = model.device, model.dtype, model.cfg
    tp = world_size(group) if group is not None else 1
    gen = torch.Generator().manual_seed(seed)
    cache = profile_cache(model, batch, contexts[-1] + max_q, kv, page)
    load_before = _load_average()
    started = time.perf_counter()
    fill_cache(model, cache, contexts[-1], fill, generator=gen)
    log.info("filled a %d-token KV cache (%s) in %.1fs", contexts[-1], fill,
             time.perf_counter() - started)
    qs = list(range(1, max_q + 1))
    raw = _timings(_Sampler(model, cache, batch, mode, gen), contexts, qs, warmup, repeats,
                   started)
    samples = _samples(raw, contexts, qs, tp, group)
    if tp > 1:
        sizes = allreduce_sizes or decode_allreduce_sizes(cfg.hidden_size, batch, max_q, dtype)
        samples["allreduce"] = measure_allreduce(group, sizes, dtype=dtype, repeats=max(repeats, 5))
    _log_cross_check(raw, contexts)
    profile = fit_profile(samples, device=_device_record(device, load_before),
                          model=dict(shape if shape is not None else cfg.shape()),
                          dtype=dtype_name(dtype), batch=batch, tp=tp,
                          torch_version=torch.__version__,
                          created=datetime.date.today().isoformat(), mode=mode, kv=kv)
    log.info("measured profile %s in %.1fs (repeats' relative spread: median %.2f over the "
             "points)", profile.key(), time.perf_counter() - started, profile.spread() or 0.0)
    return profile
