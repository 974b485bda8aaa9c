"""Attention over the KV cache for prefill, decode and verify, with per-row lengths.

Every forward feeds T new tokens per row, at positions ``starts[b] .. starts[b]+T-1``: causal
among themselves and aligned to the end of the row's keys (row b sees keys ``0 ..
starts[b]+i`` from query i). ``starts`` lives on the device, so nothing here waits on the host;
the host adds hints where it knows them for free (the largest key count, whether all rows
start together), which lets the CPU path slice the cache and drop the mask.

Backends, one per device kind, pinned rather than left to a library default:

- ``sdpa`` (CPU): PyTorch SDPA. A fresh prefill takes the ``is_causal`` kernel (it skips masked
  blocks); decode at equal lengths needs no mask; anything else gets a boolean mask. Decode and
  verify fold each KV head's query group into rows, ``[B, KV, g*T, hd]``, so each cached key is
  read once per KV head (1.6-1.8x faster attention at 8k on the CPU than per query head).
- ``flex`` (CUDA): ``flex_attention`` compiled, with a block mask built on the device from
  ``starts`` (``length_block_mask``): key blocks wholly visible are "full" (no mask_mod), the
  one or two blocks at each row's causal edge are "partial", blocks past a row's length are
  never read. GQA without repeating K/V; flex-decoding splits long rows over thread blocks.
  Its shapes are static (all ``capacity`` keys, lengths in the block mask), so the same call
  is captured in CUDA graphs. cuDNN attention, the CUDA default for bf16, rebuilt a plan for
  every new key length: 2.75x slower decoding at 4k on an H200 (../shared/gpu).
- ``sdpa`` also runs on CUDA (flash / memory-efficient kernels only, never cuDNN), as the
  fallback and the comparison that ``knapspec gpu-check`` measures.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa", "flex")
FLEX_BLOCK = 128  # flex_attention's default block size, for queries and keys


def default_backend(device: torch.device | str) -> str:
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


@dataclass
class Step:
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


def length_block_mask(starts: torch.Tensor, t: int, kv_len: int, block: int = FLEX_BLOCK):
    """flex_attention's BlockMask for T queries per row aligned to the end of each row's keys,
    computed on the device from ``starts`` [B] (no host sync, capturable in a CUDA graph).

    For query block qb (queries i in [qb*BS, min((qb+1)*BS, T))), key block kb is full when its
    last key is visible to the block's first query, ``(kb+1)*BS - 1 <= start + qb*BS``; the
    blocks from there up to the one holding the block's last visible key
    ``start + min((qb+1)*BS, T) - 1`` are partial (mask_mod decides); later blocks are skipped.
    """
    from torch.nn.attention.flex_attention import BlockMask

    q_blocks, kv_blocks = -(-t // block), -(-kv_len // block)
    qb = torch.arange(q_blocks, device=starts.device)
    first_q = starts[:, None] + qb[None] * block  # [B, QB] position of each block's first query
    last_q = starts[:, None] + torch.clamp((qb[None] + 1) * block, max=t) - 1
    full = torch.clamp((first_q + 1) // block, max=kv_blocks)
    touched = torch.clamp(last_q // block + 1, max=kv_blocks)
    partial = touched - full
    idx = torch.arange(kv_blocks, device=starts.device)
    full_idx = idx.expand(*full.shape, kv_blocks)
    partial_idx = torch.clamp(full[..., None] + idx, max=kv_blocks - 1)

    def causal_to_end(b, h, q_idx, kv_idx):
        return kv_idx <= starts[b] + q_idx

    i32 = torch.int32
    return BlockMask.from_kv_blocks(
        partial[:, None].to(i32), partial_idx[:, None].to(i32),
        full[:, None].to(i32), full_idx[:, None].to(i32),
        BLOCK_SIZE=block, mask_mod=causal_to_end, seq_lengths=(t, kv_len))


@functools.cache
def _compiled_flex():
    """One compiled kernel per (batch, T, capacity, heads): decoding meets more shapes than
    dynamo's default limit of 8 recompilations, past which it would fall back to unfused flex."""
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
    return torch.compile(flex_attention, fullgraph=True)


def _sdpa_backends():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: Step) -> torch.Tensor:
    """q [B, H, T, hd] against keys / values [B, KV, S, hd] -> [B, T, H*hd]."""
    b, h, t, hd = q.shape
    kv = keys.shape[1]
    if step.backend == "flex" and not step.causal:
        o = _compiled_flex()(q, keys, values, block_mask=step.block_mask, enable_gqa=h != kv)
    elif q.device.type == "cuda":
        with _sdpa_backends():
            o = _sdpa(q, keys, values, step)
    else:
        o = _sdpa(q, keys, values, step)
    return o.transpose(1, 2).reshape(b, t, h * hd)


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: Step) -> torch.Tensor:
    b, h, t, hd = q.shape
    kv = keys.shape[1]
    if step.causal:  # fresh prefill: the kernel's causal path, KV heads shared by GQA
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True,
                                              enable_gqa=h != kv)
    g = h // kv
    mask = step.mask()
    if mask is not None:
        mask = mask.repeat(1, 1, g, 1)
    o = F.scaled_dot_product_attention(q.reshape(b, kv, g * t, hd), keys, values, attn_mask=mask)
    return o.reshape(b, h, t, hd)
