"""Preallocated KV caches with O(1) rollback: fixed slots (``KVCache``) or pages (``PagedKVCache``).

One K and one V tensor per layer, ``[B, kv_heads, capacity, head_dim]``, allocated once. A
sequence's valid length is a number (``lengths[b]``), so rejecting a draft only moves that
number back: nothing is copied or freed, and the decode path never concatenates. The draft
writes K/V only for the attention sublayers it executes; the verifying forward then overwrites
every layer at the drafted positions, so stale draft entries beyond the length are never read.
"""

from __future__ import annotations

import torch

from knapspec_dist.model.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, *,
                 dtype: torch.dtype, device: torch.device | str, kv_heads: int | None = None):
        kv = kv_heads if kv_heads is not None else cfg.num_kv_heads
        shape = (batch, kv, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.capacity = capacity
        self.lengths = [0] * batch

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def write(self, layer: int, meta, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [B, T, KV, hd] at ``meta.positions``; return the keys/values to attend to:
        the first ``meta.kv_len`` of each row (the longest row's length, or the capacity), or,
        for per-row attention, a list of each row's own ``meta.key_counts`` [1, KV, n, hd]."""
        kc, vc = self.k[layer][meta.rows], self.v[layer][meta.rows]
        if meta.start is not None:
            t = k.shape[1]
            kc[:, :, meta.start:meta.start + t] = k.transpose(1, 2)
            vc[:, :, meta.start:meta.start + t] = v.transpose(1, 2)
        else:  # index writes from device positions: no host sync, capturable
            b = torch.arange(k.shape[0], device=k.device)[:, None]
            kc[b, :, meta.positions] = k
            vc[b, :, meta.positions] = v
        if meta.key_counts is not None:  # per-row attention: each row's own keys (views)
            return ([kc[b:b + 1, :, :n] for b, n in enumerate(meta.key_counts)],
                    [vc[b:b + 1, :, :n] for b, n in enumerate(meta.key_counts)])
        return kc[:, :, :meta.kv_len], vc[:, :, :meta.kv_len]

    def commit(self, row: int, length: int) -> None:
        """Set a row's valid length: append after a forward, or roll back a rejected draft."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"length {length} outside cache capacity {self.capacity}")
        self.lengths[row] = length

    def locate(self, rows: slice, positions: torch.Tensor, kv_len: int,
               key_counts: tuple[int, ...] | None = None):
        """Physical indices of a forward's writes and reads: none for fixed slots (a row's
        positions are its indices)."""
        return None, None, None

    def move_row(self, src: int, dst: int) -> None:
        """Row ``dst`` takes row ``src``'s keys, values and length (a retire's move)."""
        n = self.lengths[src]
        for t in self.k + self.v:
            t[dst, :, :n] = t[src, :, :n]
        self.commit(dst, n)

    def row_kv(self, layer: int, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` keys and values of one row, [1, KV, n, hd] each."""
        return self.k[layer][row:row + 1, :, :n], self.v[layer][row:row + 1, :, :n]


def kv_heads(model) -> int:
    """KV heads this process holds (local under tensor parallelism): what a KVCache for
    ``model`` needs."""
    return model.layers[0].attention.num_kv_heads
