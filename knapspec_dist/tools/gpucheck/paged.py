"""gpu-check's ``paged`` section: the KV cache in pages against fixed slots, on the device.

Per shape, at one context and batch B = 1 / 16 / 64 / 256 (``--quick``: 1 / 4), per T = 1 /
5 / 17 new tokens a row: the replayed forward over fixed slots and over a pool holding exactly
the rows' pages, in a shuffled order (model/paged_cache.py; on CUDA attention reads the pool
through flex's paged block mask, model/block_mask.py), ms and paged / fixed. The goal is paged
at most 1.05x fixed per step at equal batch. The two caches are made one after the other, so
a batch needs the memory of one.

Then identity, per B of at most 16 and T: a random model of the shape's structure in fp32,
its fixed slots as long as the pool (so that a kernel splitting the keys by their length, as
flex-decoding does, splits both alike) and the pool holding the same keys and values on
shuffled pages: whether the logits are the same bits, and their largest difference.
"""

from __future__ import annotations

import random

import torch

from knapspec_dist.engine.pages import page_size
from knapspec_dist.model.attention import attention_backend
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.paged_cache import PagedKVCache
from knapspec_dist.profiles.profiler import fill_cache
from knapspec_dist.tools.gpucheck import shapes as S
from knapspec_dist.tools.gpucheck.budget import Section
from knapspec_dist.tools.gpucheck.measure import ShapeCheck, build_random, release

IDENTITY_BATCH = 16  # the largest B of the identity rows: its fixed slots are pool-long


def paged_cache(model, rows: int, capacity: int, page: int, dtype: torch.dtype,
                seed: int = 0) -> PagedKVCache:
    """``rows`` rows of ``capacity`` positions on a pool of just their pages, shuffled."""
    blocks = -(-capacity // page)
    cache = PagedKVCache(model.cfg, rows, capacity, rows * blocks + 1, page, dtype=dtype,
                         device=model.device)
    order = list(range(1, rows * blocks + 1))
    random.Random(seed).shuffle(order)
    for row in range(rows):
        cache.assign(row, order[row * blocks:(row + 1) * blocks])
    return cache


def copy_rows(fixed: KVCache, paged: PagedKVCache, n: int) -> None:
    """The first ``n`` keys and values of each fixed row into the same row's pages."""
    keys = torch.arange(n, device=paged.table.device)
    for row in range(paged.batch):
        at = paged.table[row, keys // paged.page] * paged.page + keys % paged.page
        for src, dst in ((fixed.k, paged.k), (fixed.v, paged.v)):
            for layer in range(len(src)):
                dst[layer][:, at] = src[layer][row, :, :n]
        paged.commit(row, n)


def paged(check: ShapeCheck, section: Section, *, context: int, batches: tuple[int, ...],
          tokens: tuple[int, ...]) -> None:
    """The section's rows for one shape (gpu-check's setup gives the context, B and T)."""
    n, table = context, check.out["paged"]
    page = page_size(attention_backend(check.model))
    capacity = -(-(n + max(tokens) + 1) // 256) * 256
    for b in batches:
        for t in tokens:
            base = check.row(n, b, t=t, page=page)
            if (why := check.fit(n, b)) is not None:
                check.rows.skip(table, base, why)
                continue
            check.rows.add(table, base, lambda b=b, t=t: _timed(check, n, b, t, capacity, page),
                           section, check.first_s)
    for b in (x for x in batches if x <= IDENTITY_BATCH):
        for t in tokens:
            check.rows.add(check.out["paged_identity"], check.row(n, b, t=t, page=page),
                           lambda b=b, t=t: _identity(check, n, b, t, capacity, page), section,
                           check.first_s)


def _timed(check: ShapeCheck, n: int, b: int, t: int, capacity: int, page: int) -> dict:
    ms = {}
    for mode in ("fixed", "paged"):
        if mode == "fixed":
            cache = KVCache(check.cfg, b, capacity, dtype=check.dtype, device=check.device)
        else:
            cache = paged_cache(check.model, b, capacity, page, check.dtype)
        try:
            fill_cache(check.model, cache, n)
            _, seconds = check.first_and_replay(check.timer(cache, slice(0, b)), n, t)
            ms[mode] = 1e3 * seconds
        finally:
            del cache
            release(check.device)
    return {"fixed_ms": ms["fixed"], "paged_ms": ms["paged"],
            "ratio": ms["paged"] / ms["fixed"]}


def _identity(check: ShapeCheck, n: int, b: int, t: int, capacity: int, page: int) -> dict:
    """fp32 logits over fixed slots as long as the pool and over the pool: the same bits? A
    small random model with the shape's query heads per KV head (the kernel flex picks)."""
    group = check.cfg.num_heads // check.cfg.num_kv_heads
    cfg = S.llama(512, 2 * group * 32, 256, 4, 2 * group, 2, 32)
    model = build_random(cfg, check.device, torch.float32, seed=1)
    model.backend = check.model.backend
    pool = paged_cache(model, b, capacity, page, torch.float32, seed=b + t)
    fixed = KVCache(cfg, b, pool.n_pages * page, dtype=torch.float32, device=check.device)
    try:
        fill_cache(model, fixed, n)
        copy_rows(fixed, pool, n)
        gen = torch.Generator().manual_seed(t)
        tokens = torch.randint(cfg.vocab_size, (b, t), generator=gen).to(check.device)
        starts = [n - 7 * (i % 3) for i in range(b)]  # rows at other lengths
        out = {}
        for name, cache in (("fixed", fixed), ("paged", pool)):
            for row, s in enumerate(starts):
                cache.commit(row, s)
            out[name] = model(tokens, starts, cache).float()
        return {"identical": bool(torch.equal(out["fixed"], out["paged"])),
                "max_diff": (out["fixed"] - out["paged"]).abs().max().item(),
                "pool_positions": pool.n_pages * page, "fixed_capacity": fixed.capacity}
    finally:
        del model, pool, fixed
        release(check.device)
