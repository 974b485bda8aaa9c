"""A KV cache in pages: rows hold only the positions they were given, not a whole window.

Per layer one K and one V pool, ``[n_pages * page, kv_heads, head_dim]``, allocated once, and
a block table ``[rows, max_blocks]`` mapping each row's logical block to a physical page. The
pool is position-major: a gather then copies whole positions (every KV head at once), 2.5-3x
faster on a CPU than one head's rows at a time (SmolLM2's 3 x 64 floats a position). Page
0 is a scratch page that no row owns: free rows' tables point only at it, so a padded or free
row writes there and never into a live row's pages. Which pages a row gets is decided outside
(engine/pages.py); the cache only records them.

The interface is ``KVCache``'s: ``write`` / ``commit`` / ``lengths``. Rolling back a rejected
draft moves the length back (the pages stay the row's); retiring a row moves its block-table
row, never its keys and values. A forward's physical indices (``locate``) are made once, in
the ``ForwardMeta`` every layer shares. SDPA then reads a contiguous copy of the rows' keys
(``index_select``), the same values in the same shapes as the fixed cache's slice, so it gives
the same bits. flex reads the pool itself through a block mask over pages
(model/block_mask.py), for which the cache keeps the table's inverse, ``logical``: each page's
block in the row that holds it. Both tables are device tensors changed in place, so CUDA graphs
captured over them stay valid as rows come and go.
"""

from __future__ import annotations

import torch

from knapspec_dist.model.config import ModelConfig

SCRATCH = 0  # the page free rows point at


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, n_pages: int, page: int, *,
                 dtype: torch.dtype, device: torch.device | str, kv_heads: int | None = None):
        """``batch`` rows of at most ``capacity`` positions each, over ``n_pages`` pages of
        ``page`` positions (the scratch page included)."""
        if page < 1 or n_pages < 2:
            raise ValueError(f"a paged cache needs page >= 1 and 2+ pages, got {page}, {n_pages}")
        kv = kv_heads if kv_heads is not None else cfg.num_kv_heads
        shape = (n_pages * page, kv, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.page, self.n_pages = page, n_pages
        self.max_blocks = -(-capacity // page)
        self.capacity = self.max_blocks * page
        self.table = torch.full((batch, self.max_blocks), SCRATCH, dtype=torch.int64,
                                device=device)
        self.logical = torch.zeros(n_pages, dtype=torch.int64, device=device)
        self.pages: list[list[int]] = [[] for _ in range(batch)]  # the table's host mirror
        self.lengths = [0] * batch

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def kv_heads(self) -> int:
        return self.k[0].shape[1]

    def reserved(self, row: int) -> int:
        """Positions a row may fill: its pages'."""
        return len(self.pages[row]) * self.page

    def assign(self, row: int, pages: list[int]) -> None:
        """Give an empty row its pages, in logical order."""
        if self.pages[row]:
            raise ValueError(f"row {row} already holds {len(self.pages[row])} pages")
        if len(pages) > self.max_blocks or SCRATCH in pages:
            raise ValueError(f"row {row}: {len(pages)} pages for {self.max_blocks} blocks, "
                             f"or the scratch page among them")
        self.pages[row] = list(pages)
        if pages:
            index = torch.tensor(pages, dtype=torch.int64).to(self.table.device)
            self.table[row, :len(pages)] = index
            self.logical[index] = torch.arange(len(pages), device=self.table.device)

    def release(self, row: int) -> list[int]:
        """Empty a row; the pages it held."""
        pages, self.pages[row] = self.pages[row], []
        self.table[row].fill_(SCRATCH)
        self.lengths[row] = 0
        return pages

    def move_row(self, src: int, dst: int) -> None:
        """Row ``dst`` (empty) takes row ``src``'s pages and length; ``src`` is left empty."""
        if self.pages[dst]:
            raise ValueError(f"row {dst} still holds pages")
        self.table[dst] = self.table[src]
        self.pages[dst], self.lengths[dst] = self.pages[src], self.lengths[src]
        self.pages[src] = []
        self.table[src].fill_(SCRATCH)
        self.lengths[src] = 0

    def commit(self, row: int, length: int) -> None:
        """Set a row's valid length: append after a forward, or roll back a rejected draft."""
        if not 0 <= length <= self.reserved(row):
            raise ValueError(f"length {length} outside row {row}'s {self.reserved(row)} "
                             "reserved positions")
        self.lengths[row] = length

    def locate(self, rows: slice, positions: torch.Tensor, kv_len: int | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Physical positions of the new tokens [B, T], and of each row's first ``kv_len``
        keys [B * kv_len] (None: flex, which reads the pool): made once per forward, shared
        by every layer."""
        table = self.table[rows]
        slots = table.gather(1, positions // self.page) * self.page + positions % self.page
        if kv_len is None:
            return slots, None
        keys = torch.arange(kv_len, device=table.device)
        gather = table[:, keys // self.page] * self.page + keys % self.page
        return slots, gather.reshape(-1)

    def write(self, layer: int, meta, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, T, KV, hd] at ``meta.slots``; the rows' first ``meta.kv_len`` keys and
        values, [B, KV, kv_len, hd], or (flex: no ``meta.gather``) the pool, [1, KV, pool, hd]
        (views)."""
        kp, vp = self.k[layer], self.v[layer]
        kp[meta.slots] = k
        vp[meta.slots] = v
        if meta.gather is None:
            return kp.permute(1, 0, 2)[None], vp.permute(1, 0, 2)[None]
        shape = (k.shape[0], meta.kv_len, kp.shape[1], kp.shape[2])
        return (kp.index_select(0, meta.gather).view(shape).transpose(1, 2),
                vp.index_select(0, meta.gather).view(shape).transpose(1, 2))

    def row_kv(self, layer: int, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` keys and values of one row, [1, KV, n, hd] each (a copy)."""
        keys = torch.arange(n, device=self.table.device)
        idx = self.table[row, keys // self.page] * self.page + keys % self.page
        return (self.k[layer].index_select(0, idx).transpose(0, 1)[None],
                self.v[layer].index_select(0, idx).transpose(0, 1)[None])
