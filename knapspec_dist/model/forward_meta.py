"""Per-forward metadata every layer shares (``ForwardMeta``), built once per forward by
``forward_meta``.

A forward feeds T new tokens per row at positions ``starts[b] .. starts[b]+T-1``. Its meta
holds those positions on the device, the rotary tables for them, the cache rows and the key
count attention reads, and (flex) the block mask, so no layer rebuilds any of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask

from knapspec_dist.model.attention import FLEX_BLOCK, canonical, default_backend
from knapspec_dist.model.transfer import upload

# Torch 2.11 and later can skip the backward (q) indices of a BlockMask, which inference never
# reads: about a third of the ops of building one (gpu-check's ``block_mask_ops``).
SKIP_Q_BLOCKS = "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


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
    gather: torch.Tensor | None = None  # paged cache: physical positions of the keys read
    _mask: torch.Tensor | None = field(default=None, repr=False)

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


def length_block_mask(starts: torch.Tensor, t: int, kv_len: int, block: int = FLEX_BLOCK, *,
                      q_blocks: bool = not SKIP_Q_BLOCKS):
    """flex_attention's BlockMask for T queries per row aligned to the end of each row's keys,
    computed on the device from ``starts`` [B] (no host sync, capturable in a CUDA graph).

    For query block qb (queries i in [qb*BS, min((qb+1)*BS, T))), key block kb is full when its
    last key is visible to the block's first query, ``(kb+1)*BS - 1 <= start + qb*BS``; the
    blocks from there up to the one holding the block's last visible key
    ``start + min((qb+1)*BS, T) - 1`` are partial (mask_mod decides); later blocks are skipped.
    ``q_blocks``: also build the backward's indices (only gpu-check's ``block_mask_ops`` asks,
    to compare).
    """
    starts = canonical(starts)  # a view into a round's packed upload: one stride, one guard
    q_blocks_n, kv_blocks = -(-t // block), -(-kv_len // block)
    qb = torch.arange(q_blocks_n, device=starts.device)
    first_q = starts[:, None] + qb[None] * block  # [B, QB] position of each block's first query
    last_q = starts[:, None] + torch.clamp((qb[None] + 1) * block, max=t) - 1
    full = torch.clamp((first_q + 1) // block, max=kv_blocks)
    touched = torch.clamp(last_q // block + 1, max=kv_blocks)
    partial = touched - full
    idx = torch.arange(kv_blocks, device=starts.device)
    full_idx = idx.expand(*full.shape, kv_blocks)
    partial_idx = torch.clamp(full[..., None] + idx, max=kv_blocks - 1)
    torch._dynamo.mark_static(starts, 0)  # the mask_mod's closure: an integer batch (attention)

    def causal_to_end(b, h, q_idx, kv_idx):
        return kv_idx <= starts[b] + q_idx

    i32 = torch.int32
    skip = {"compute_q_blocks": False} if SKIP_Q_BLOCKS and not q_blocks else {}
    return BlockMask.from_kv_blocks(
        partial[:, None].to(i32), partial_idx[:, None].to(i32),
        full[:, None].to(i32), full_idx[:, None].to(i32),
        BLOCK_SIZE=block, mask_mod=causal_to_end, seq_lengths=(t, kv_len), **skip)


def forward_meta(model, starts: Sequence[int] | torch.Tensor, t: int, cache,
                 rows: slice, starts_dev: torch.Tensor | None = None) -> ForwardMeta:
    """Everything the layers share for ``t`` new tokens per row at ``starts[b] ..``.

    Host ``starts`` (eager forwards) give the largest key count, a common start and a fresh
    prefill for free; a device tensor (CUDA-graph capture) gives none of them, and attention
    then reads all ``cache.capacity`` keys with the lengths on the device. ``starts_dev``: the
    host ``starts`` already on the device (the round's upload), else they are uploaded here.
    Nothing here reads a device tensor back.
    """
    backend = model.backend or default_backend(model.device)
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
    slots, gather = cache.locate(rows, positions, kv_len)
    if slots is not None and backend == "flex":
        raise ValueError("a paged KV cache runs on the sdpa backend only")
    block_mask = None
    if backend == "flex" and not causal:
        block_mask = length_block_mask(starts_dev, t, kv_len)
    return ForwardMeta(starts_dev, positions, cos, sin, rows, kv_len, start, causal, backend,
                       block_mask, slots, gather)

