"""Per-forward metadata every layer shares (``ForwardMeta``), built once per forward by
``forward_meta``.

A forward feeds T new tokens per row at positions ``starts[b] .. starts[b]+T-1``. Its meta
holds those positions on the device, the rotary tables for them, the cache rows and the key
count attention reads, and (flex) the block mask, so no layer rebuilds any of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from knapspec_dist.model.attention import attends_per_row, attention_backend
from knapspec_dist.model.block_mask import length_block_mask, paged_block_mask
from knapspec_dist.model.kernels.paged_attention import check_indices
from knapspec_dist.model.transfer import upload


@dataclass
class ForwardMeta:
    """Per-forward inputs shared by every layer: where the new tokens go, rotary tables, and
    what attention needs to know about each row's keys."""

    starts: torch.Tensor  # [B] int64, the first new token's position in each row (device)
    positions: torch.Tensor  # [B, T] absolute positions of the new tokens
    cos: torch.Tensor  # [B, 1, T, head_dim]
    sin: torch.Tensor
    rows: slice  # cache rows of this batch
    kv_len: int  # keys handed to attention: the rows' largest length (host hint) or capacity
    start: int | None = None  # common start of every row, when the host knows it (slice writes)
    causal: bool = False  # a fresh prefill of equal-length rows: plain causal attention
    backend: str = "sdpa"
    block_mask: object | None = None  # flex: built once per forward, shared by all layers
    slots: torch.Tensor | None = None  # paged cache: physical positions of the new tokens
    gather: torch.Tensor | None = None  # paged sdpa: physical positions of the keys read
    key_counts: tuple[int, ...] | None = None  # per-row attention: each row's keys (host)
    row_offsets: tuple[int | None, ...] | None = None  # paged, per row: where its keys start
    # in the pool when they are consecutive there (None: gathered)
    table: torch.Tensor | None = None  # our CPU kernel: the rows' pages (keys laid out by dims)
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _row_masks: dict = field(default_factory=dict, repr=False)

    @property
    def tokens(self) -> int:
        return self.positions.shape[1]

    def mask(self) -> torch.Tensor | None:
        """SDPA's boolean mask [B, 1, T, kv_len], or None where none is needed."""
        if self.causal or (self.tokens == 1 and self.start is not None):
            return None
        if self._mask is None:
            keys = torch.arange(self.kv_len, device=self.positions.device)
            self._mask = keys[None, None, None, :] <= self.positions[:, None, :, None]
        return self._mask

    def row_mask(self, row: int, keys: int, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Row ``row``'s additive mask over its first ``keys`` keys for its queries folded by
        KV head, ``[1, 1, group * T, keys]`` of 0 and -inf: made once per forward, not per
        layer. SDPA turns a boolean mask into this same one on every call (``where``: 20 ms a
        layer for a 2k chunk at 4k keys), and the fold repeats it per query group."""
        mask = self._row_masks.get(row)
        if mask is None:
            seen = torch.arange(keys, device=self.positions.device)[None, :] \
                <= self.positions[row][:, None]
            mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
            mask.masked_fill_(~seen, float("-inf"))
            mask = mask.repeat(group, 1)[None, None]
            self._row_masks[row] = mask
        return mask


def forward_meta(model, starts: Sequence[int] | torch.Tensor, t: int, cache,
                 rows: slice, starts_dev: torch.Tensor | None = None) -> ForwardMeta:
    """Everything the layers share for ``t`` new tokens per row at ``starts[b] ..``.

    Host ``starts`` (eager forwards) give the largest key count, a common start and a fresh
    prefill for free; a device tensor (CUDA-graph capture) gives none of them, and attention
    then reads all ``cache.capacity`` keys with the lengths on the device. ``starts_dev``: the
    host ``starts`` already on the device (the round's upload), else they are uploaded here.
    Nothing here reads a device tensor back.
    """
    backend = attention_backend(model)
    kernel = getattr(cache, "key_layout", "positions") == "dims"
    if isinstance(starts, torch.Tensor):
        if starts.dim() != 1:
            raise ValueError("starts must be one position per row, got shape "
                             f"{tuple(starts.shape)}")
        starts_dev, kv_len, start, causal = starts, cache.capacity, None, False
    else:
        starts = list(starts)
        kv_len = max(starts) + t
        if kv_len > cache.capacity:
            raise ValueError(f"KV cache capacity {cache.capacity} exceeded (need {kv_len})")
        start = starts[0] if all(s == starts[0] for s in starts) else None
        # A fresh prefill says is_causal instead of passing a mask: only then does the CPU
        # kernel skip the masked-out blocks (-39% prefill time at 4k).
        causal = start == 0 and t > 1
        if starts_dev is None:
            starts_dev = upload(starts, model.device)
        if backend == "flex" and not causal:
            kv_len = cache.capacity  # static shapes: one compiled kernel per (B, T)
    positions = starts_dev[:, None] + torch.arange(t, device=model.device)[None]
    freqs = positions[..., None].float() * model.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    cos = (emb.cos() * model.rope_scale).to(model.dtype)
    sin = (emb.sin() * model.rope_scale).to(model.dtype)
    flex = backend == "flex" and not causal and not kernel
    # On a CPU each row attends to its own keys: no key is read for padding to the longest
    # row, and a row's result does not depend on the rows beside it (model/attention.py).
    key_counts = None
    if not flex and not causal and not kernel and not isinstance(starts, torch.Tensor) \
            and attends_per_row(model.device):
        key_counts = tuple(s + t for s in starts)
    slots, gather, row_offsets = cache.locate(rows, positions,
                                              None if flex or kernel else kv_len, key_counts)
    block_mask = None
    if flex and slots is not None:  # the pool's keys, read through the block table
        block_mask = paged_block_mask(starts_dev, t, cache.table[rows], cache.logical,
                                      cache.page)
    elif flex:
        block_mask = length_block_mask(starts_dev, t, kv_len)
    table = None
    if kernel:  # the rows' pages, checked once here for every layer's kernel call
        table = cache.table[rows].contiguous()
        check_indices(table, starts_dev, t, cache.n_pages)
    return ForwardMeta(starts_dev, positions, cos, sin, rows, kv_len, start, causal, backend,
                       block_mask, slots, gather, key_counts, row_offsets, table)

