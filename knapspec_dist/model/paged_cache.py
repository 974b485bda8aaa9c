"""A KV cache in pages: rows hold only the positions they were given, not a whole window.

Per layer one K and one V pool, ``[kv_heads, n_pages * page, head_dim]``, allocated once, and
a block table ``[rows, max_blocks]`` mapping each row's logical block to a physical page. Page
0 is a scratch page that no row owns: free rows' tables point only at it, so a padded or free
row writes there and never into a live row's pages. Which pages a row gets is decided outside
(engine/pages.py); the cache only records them.

The interface is ``KVCache``'s: ``write`` / ``commit`` / ``lengths``. Rolling back a rejected
draft moves the length back (the pages stay the row's); retiring a row moves its block-table
row, never its keys and values. A forward's physical indices (``locate``) are made once, in
the ``ForwardMeta`` every layer shares.

SDPA (CPU) attends row by row (model/attention.py). A row on consecutive pages, which the block
manager hands out where it can, is read in place: a view of the pool laid out as a fixed slot
is, head by head, so its keys are the same values in the same layout and give the same bits.
The other rows' keys are gathered (``index_select``) into a buffer kept between layers. (A
position-major pool gathers 2.5-3x faster, but SDPA read its strided heads 1.7x slower in a
SmolLM2 decode at 9 rows, and in place there is nothing to gather.) flex reads the pool itself
through a block mask over pages
(model/block_mask.py), for which the cache keeps the table's inverse, ``logical``: each page's
block in the row that holds it. Both tables are device tensors changed in place, so CUDA graphs
captured over them stay valid as rows come and go.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from knapspec_dist.model.config import ModelConfig
from knapspec_dist.model.transfer import upload

SCRATCH = 0  # the page free rows point at
KEY_LAYOUTS = ("positions", "dims")


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, n_pages: int, page: int, *,
                 dtype: torch.dtype, device: torch.device | str, kv_heads: int | None = None,
                 key_layout: str = "positions"):
        """``batch`` rows of at most ``capacity`` positions each, over ``n_pages`` pages of
        ``page`` positions (the scratch page included). ``key_layout``: "positions" (keys
        ``[KV, n_pages * page, hd]``, as values are) or "dims" (``[KV, n_pages, hd, page]``:
        each page's keys dims-major, what our CPU kernel reads,
        model/kernels/paged_attention.py)."""
        if page < 1 or n_pages < 2:
            raise ValueError(f"a paged cache needs page >= 1 and 2+ pages, got {page}, {n_pages}")
        if key_layout not in KEY_LAYOUTS:
            raise ValueError(f"key_layout must be one of {KEY_LAYOUTS}, got {key_layout!r}")
        kv = kv_heads if kv_heads is not None else cfg.num_kv_heads
        shape = (kv, n_pages * page, cfg.head_dim)
        self.key_layout = key_layout
        key_shape = shape if key_layout == "positions" else (kv, n_pages, cfg.head_dim, page)
        self.k = [torch.zeros(key_shape, dtype=dtype, device=device)
                  for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.page, self.n_pages = page, n_pages
        self.max_blocks = -(-capacity // page)
        self.capacity = self.max_blocks * page
        self.table = torch.full((batch, self.max_blocks), SCRATCH, dtype=torch.int64,
                                device=device)
        self.logical = torch.zeros(n_pages, dtype=torch.int64, device=device)
        self.pages: list[list[int]] = [[] for _ in range(batch)]  # the table's host mirror
        self.lengths = [0] * batch
        self.consecutive = [False] * batch  # whether a row's pages are one run of the pool
        self._reads = [torch.empty(0, dtype=dtype, device=device)
                       for _ in range(2)]  # gathered keys and values, reused by every layer

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def kv_heads(self) -> int:
        return self.k[0].shape[0]

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
        self.consecutive[row] = all(b == a + 1 for a, b in zip(pages, pages[1:]))
        if pages:
            index = torch.tensor(pages, dtype=torch.int64).to(self.table.device)
            self.table[row, :len(pages)] = index
            self.logical[index] = torch.arange(len(pages), device=self.table.device)

    def release(self, row: int) -> list[int]:
        """Empty a row; the pages it held."""
        pages, self.pages[row] = self.pages[row], []
        self.consecutive[row] = False
        self.table[row].fill_(SCRATCH)
        self.lengths[row] = 0
        return pages

    def move_row(self, src: int, dst: int) -> None:
        """Row ``dst`` (empty) takes row ``src``'s pages and length; ``src`` is left empty."""
        if self.pages[dst]:
            raise ValueError(f"row {dst} still holds pages")
        self.table[dst] = self.table[src]
        self.pages[dst], self.lengths[dst] = self.pages[src], self.lengths[src]
        self.consecutive[dst], self.consecutive[src] = self.consecutive[src], False
        self.pages[src] = []
        self.table[src].fill_(SCRATCH)
        self.lengths[src] = 0

    def aliases(self, rows: int) -> PagedKVCache:
        """A cache of ``rows`` rows over this one's pools, every row empty until ``alias``
        points it at one of this cache's rows: what a ragged verify runs over, each of its
        rows one token of a real row (engine/ragged.py). Its table is a tensor of its own,
        changed in place, so graphs captured over it stay valid."""
        out = copy.copy(self)
        out.table = torch.full((rows, self.max_blocks), SCRATCH, dtype=self.table.dtype,
                               device=self.table.device)
        out.pages, out.lengths = [[] for _ in range(rows)], [0] * rows
        out.consecutive = [False] * rows
        return out

    def alias(self, source: PagedKVCache, index: Sequence[int]) -> None:
        """Row i reads and writes ``source``'s row ``index[i]`` (its pages and length), the
        rows past them none (the scratch page, length 0). Both share the pools: a write
        through an alias row is a write into the source row's pages."""
        n = len(index)
        if n > self.batch:
            raise ValueError(f"{n} aliased rows for a cache of {self.batch}")
        rows = upload(list(index), source.table.device)  # every round: never a host wait
        self.table[:n] = source.table.index_select(0, rows)
        self.table[n:].fill_(SCRATCH)
        pad = self.batch - n
        self.pages = [source.pages[i] for i in index] + [[]] * pad
        self.lengths = [source.lengths[i] for i in index] + [0] * pad
        self.consecutive = [source.consecutive[i] for i in index] + [False] * pad

    def commit(self, row: int, length: int) -> None:
        """Set a row's valid length: append after a forward, or roll back a rejected draft."""
        if not 0 <= length <= self.reserved(row):
            raise ValueError(f"length {length} outside row {row}'s {self.reserved(row)} "
                             "reserved positions")
        self.lengths[row] = length

    def locate(self, rows: slice, positions: torch.Tensor, kv_len: int | None,
               key_counts: tuple[int, ...] | None = None):
        """Where a forward writes and reads, made once and shared by every layer: the physical
        positions of the new tokens [B, T]; those of the keys attention reads, each row's first
        ``kv_len`` [B * kv_len], or None (flex, which reads the pool); and None.

        Per-row attention (``key_counts``): a row whose keys lie on consecutive pages is read
        as a view of the pool, at the offset given (the third item, per row); the others'
        keys are gathered one row after another (the second item; None if there are none)."""
        table = self.table[rows]
        slots = table.gather(1, positions // self.page) * self.page + positions % self.page
        if kv_len is None:
            return slots, None, None
        if key_counts is None:
            keys = torch.arange(kv_len, device=table.device)
            gather = table[:, keys // self.page] * self.page + keys % self.page
            return slots, gather.reshape(-1), None
        first = rows.start or 0
        offsets = tuple(self._run_start(first + b, n) for b, n in enumerate(key_counts))
        scattered = [b for b, off in enumerate(offsets) if off is None]
        if not scattered:
            return slots, None, offsets
        counts = torch.tensor([key_counts[b] for b in scattered], device=table.device)
        row = torch.repeat_interleave(torch.tensor(scattered, device=table.device), counts)
        keys = torch.arange(int(counts.sum()), device=table.device)
        keys -= torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        return slots, table[row, keys // self.page] * self.page + keys % self.page, offsets

    def _run_start(self, row: int, n: int) -> int | None:
        """The first physical position of a row's keys if its pages are consecutive in the
        pool (fixed at ``assign``), else None."""
        if not self.consecutive[row] or n > self.reserved(row):
            return None
        return self.pages[row][0] * self.page

    def write(self, layer: int, meta, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, T, KV, hd] at ``meta.slots``; return what attention reads: the rows'
        first ``meta.kv_len`` keys and values, [B, KV, kv_len, hd]; for per-row attention
        (``meta.key_counts``) a list of each row's own, [1, KV, n, hd]; or (flex: no
        ``meta.gather``) the pool, [1, KV, pool, hd]."""
        kp, vp = self.k[layer], self.v[layer]
        vp[:, meta.slots] = v.permute(2, 0, 1, 3)
        if self.key_layout == "dims":  # what the CPU kernel reads: the pools themselves
            slots = meta.slots.reshape(-1)
            kp[:, slots // self.page, :, slots % self.page] = k.reshape(-1, *k.shape[2:])
            return kp, vp
        kp[:, meta.slots] = k.permute(2, 0, 1, 3)
        if meta.key_counts is not None:
            return self._row_reads(kp, meta, 0), self._row_reads(vp, meta, 1)
        if meta.gather is None:
            return kp[None], vp[None]
        shape = (kp.shape[0], k.shape[0], meta.kv_len, kp.shape[2])
        return (self._read(0, kp, meta.gather).view(shape).transpose(0, 1),
                self._read(1, vp, meta.gather).view(shape).transpose(0, 1))

    def _row_reads(self, pool: torch.Tensor, meta, which: int) -> list[torch.Tensor]:
        """Each row's own keys (or values), [1, KV, n, hd]: a view of the pool where they are
        consecutive, else their place in one gather of the other rows'."""
        gathered = self._read(which, pool, meta.gather) if meta.gather is not None else None
        out, at = [], 0
        for n, off in zip(meta.key_counts, meta.row_offsets):
            if off is None:
                out.append(gathered[None, :, at:at + n])
                at += n
            else:
                out.append(pool[None, :, off:off + n])
        return out

    def _read(self, which: int, pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``pool[:, index]`` into a buffer kept for the next layer: a fresh tensor of a
        forward's keys (tens of MB at a few rows of a few thousand positions) costs its page
        faults on every layer, and on a CPU those took longer than the copy itself."""
        shape = (pool.shape[0], index.shape[0], pool.shape[2])
        need = shape[0] * shape[1] * shape[2]
        if self._reads[which].numel() < need:
            self._reads[which] = pool.new_empty(need)
        return torch.index_select(pool, 1, index, out=self._reads[which][:need].view(shape))

    def row_kv(self, layer: int, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` keys and values of one row, [1, KV, n, hd] each (a copy)."""
        keys = torch.arange(n, device=self.table.device)
        pages = self.table[row, keys // self.page]
        idx = pages * self.page + keys % self.page
        if self.key_layout == "dims":
            k = self.k[layer][:, pages, :, keys % self.page].transpose(0, 1)
        else:
            k = self.k[layer].index_select(1, idx)
        return k[None], self.v[layer].index_select(1, idx)[None]
