"""Attention over the KV cache for prefill, decode and verify, with per-row lengths.

Every forward feeds T new tokens per row, at positions ``starts[b] .. starts[b]+T-1``: causal
among themselves and aligned to the end of the row's keys (row b sees keys ``0 ..
starts[b]+i`` from query i). ``starts`` lives on the device, so nothing here waits on the host;
the host adds hints where it knows them for free (the largest key count, whether all rows
start together), which lets the CPU path slice the cache and drop the mask.

Backends, one per device kind, pinned rather than left to a library default:

- ``sdpa`` (CPU, where our kernel does not run): PyTorch SDPA. A fresh prefill takes the
  ``is_causal`` kernel (it skips masked blocks). Every other forward attends row by row,
  each row over its own keys (``ForwardMeta.key_counts``): no key is read for padding a row
  to the longest one, a decode (T = 1) needs no mask, and a row's result does not depend on
  the rows beside it; over a paged cache a row on consecutive pages is read in place
  (model/paged_cache.py). Decode and verify fold each KV head's query group into rows,
  ``[KV, g*T, hd]``, so each cached key is read once per KV head.
- ``flex`` (CUDA): ``flex_attention`` compiled, with a block mask built on the device from
  ``starts`` (model/block_mask.py): key blocks wholly visible are "full" (no mask_mod), the
  one or two blocks at each row's causal edge are "partial", blocks past a row's length are
  never read. Over a paged cache the keys are the page pool itself (batch 1, broadcast over
  the rows) and the mask's blocks are the rows' pages. GQA without repeating K/V;
  flex-decoding splits long rows over thread blocks where query heads / KV heads is a power
  of two (torch's lowering takes it only then: a
  model with 9 / 3 heads, SmolLM2, gets the main flex kernel, with no split over the keys).
  Its shapes are static (all ``capacity`` keys, lengths in the block mask), so the same call
  is captured in CUDA graphs; the batch and head dims are integers in the compiled graph (the
  flex-decoding kernel needs them), and the runner pads the batch to a power of two
  (engine/buckets.py), so continuous batching compiles a few kernels, not one per batch size.
  cuDNN attention, the CUDA default for bf16, rebuilt a plan for every new key length: 2.75x
  slower decoding at 4k on an H200 (docs/gpu-measurements.md).
- ``cpu`` (a CPU our kernels are built for, model/kernels/build.py; fp32 or bf16): our own
  kernel over the pages, every row and head of a forward in one call, prefill, decode and
  verify alike (model/kernels/paged_attention.py); its cache keeps keys by dims
  (``key_layout``).
- ``sdpa`` also runs on CUDA (flash / memory-efficient kernels only, never cuDNN), as the
  fallback and the comparison that ``knapspec gpu-check`` measures.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from knapspec_dist.model.kernels.paged_attention import PAGE as KERNEL_PAGE
from knapspec_dist.model.kernels.paged_attention import paged_attention, supports

BACKENDS = ("sdpa", "flex", "cpu")
FLEX_BLOCK = 128  # flex_attention's default block size, for queries and keys


def default_backend(device: torch.device | str) -> str:
    """The device's backend family (its page size): flex on CUDA, SDPA's on a CPU."""
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def attention_backend(model) -> str:
    """The backend a model's forwards use: its own choice (``model.backend``), else flex on
    CUDA, and on a CPU our paged kernel where it runs (model/kernels/paged_attention.py),
    else SDPA."""
    if model.backend is not None:
        return model.backend
    if torch.device(model.device).type == "cuda":
        return "flex"
    return "cpu" if supports(model.dtype, model.cfg.head_dim) else "sdpa"


def attends_per_row(device: torch.device | str) -> bool:
    """Whether SDPA attends row by row, each row over its own keys: on a CPU (see above)."""
    return torch.device(device).type == "cpu"


def key_layout(backend: str, page: int) -> str:
    """How a paged cache of ``page``-position pages lays out its keys for a backend
    (model/paged_cache.py): by dims where our CPU kernel reads them (its pages hold 16
    positions; a cache of other pages is attended by SDPA)."""
    return "dims" if backend == "cpu" and page == KERNEL_PAGE else "positions"


_BLOCK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices", "BLOCK_SIZE",
                 "mask_mod")


def _flex_static_batch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask,
                       enable_gqa: bool) -> torch.Tensor:
    """flex_attention with the batch and head dims forced static: torch's lowering takes the
    flex-decoding kernel (split-K, GQA-shared) only for an integer batch and head count, and
    dynamo would otherwise make the batch symbolic at its second batch size. Marked inside the
    compiled function, so calls pay nothing (dynamo specializes the dims; the lowering sees
    integers); the mask_mod's closure (``starts``) is marked where it is made, in
    ``length_block_mask``. The block mask is rewrapped with its lengths taken from q and the
    keys: its own ``seq_lengths`` are Python ints, and flex's shape checks against them would
    specialize the symbolic T and capacity (``dynamic_lengths``) back to constants."""
    for x in (q, keys, values):
        torch._dynamo.mark_static(x, 0)
        torch._dynamo.mark_static(x, 1)
    for x in block_mask.as_tuple(flatten=False)[1:]:
        if isinstance(x, torch.Tensor):
            torch._dynamo.mark_static(x, 0)
    block_mask = BlockMask((q.shape[2], keys.shape[2]),
                           *(getattr(block_mask, f) for f in _BLOCK_FIELDS))
    return flex_attention(q, keys, values, block_mask=block_mask, enable_gqa=enable_gqa)


def dynamic_lengths(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    block_mask) -> None:
    """Mark the query length T and the cache capacity dynamic before the first compile.
    Dynamo would make each symbolic only at its second value, after compiling a static graph
    for the first one: each (bucket, T = 1 or T > 1) would compile again at the second
    capacity. A length of 1 stays specialized (dynamo's 0/1 rule), so T = 1 keeps its own
    graph (flex-decoding)."""
    torch._dynamo.maybe_mark_dynamic(q, 2)
    for x in (keys, values):
        torch._dynamo.maybe_mark_dynamic(x, 2)
    for x in (block_mask.kv_indices, block_mask.full_kv_indices):
        if x is not None:  # [B, H, q blocks, kv blocks]
            torch._dynamo.maybe_mark_dynamic(x, 3)


@functools.cache
def compiled_flex(backend: str | Callable = "inductor") -> Callable:
    """One compiled kernel per (batch bucket, T = 1 or T > 1, heads): the batch is static and
    padded to a few buckets (engine/buckets.py), T > 1 and the capacity are dynamic from the
    first compile (``dynamic_lengths``). Decoding meets more shapes than
    dynamo's default limit of 8 recompilations, past which it would fall back to unfused flex.
    ``backend``: tests pass a counting one (torch._dynamo.testing). (``torch._dynamo`` is
    read through torch's lazy attribute: importing it costs seconds, so only a process that
    compiles pays them.)"""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 256)
    return torch.compile(_flex_static_batch, fullgraph=True, backend=backend)


def _sdpa_backends():
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


def canonical(x: torch.Tensor) -> torch.Tensor:
    """``x`` with row-major strides, size-1 dims included: dynamo guards on every stride of a
    compiled function's tensors, and a T = 1 query (or a batch-1 ``starts``, a view into a
    round's packed upload) reaches flex with other strides as well (a recompile each); a copy
    of one step's queries is cheap."""
    want, step = [], 1
    for size in reversed(x.shape):
        want.append(step)
        step *= size
    if x.stride() == tuple(reversed(want)):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def attend(q: torch.Tensor, keys, values, meta) -> torch.Tensor:
    """q [B, H, T, hd] against keys / values [B, KV, S, hd], or per-row lists of [1, KV, n, hd]
    (``meta.key_counts``) -> [B, T, H*hd]."""
    b, h, t, hd = q.shape
    if meta.table is not None:  # our CPU kernel, over the pools (keys laid out by dims)
        return paged_attention(q, keys, values, meta.table, meta.starts, checked=True)
    if meta.key_counts is not None:
        o = torch.cat([_sdpa(q[i:i + 1], keys[i], values[i], meta, i)
                       for i in range(b)])
        return o.transpose(1, 2).reshape(b, t, h * hd)
    kv = keys.shape[1]
    if meta.backend == "flex" and not meta.causal:
        q = canonical(q)
        dynamic_lengths(q, keys, values, meta.block_mask)
        o = compiled_flex()(q, keys, values, meta.block_mask, h != kv)
    elif q.device.type == "cuda":
        with _sdpa_backends():
            o = _sdpa(q, keys, values, meta)
    else:
        o = _sdpa(q, keys, values, meta)
    return o.transpose(1, 2).reshape(b, t, h * hd)


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta,
          row: int | None = None) -> torch.Tensor:
    """``row``: one row of the batch against its own keys (no padding, no mask at T = 1)."""
    b, h, t, hd = q.shape
    kv = keys.shape[1]
    if meta.causal:  # fresh prefill: the kernel's causal path, KV heads shared by GQA
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True,
                                              enable_gqa=h != kv)
    g = h // kv
    if row is not None:  # its own keys: no mask for one query, else the forward's row mask
        mask = meta.row_mask(row, keys.shape[2], g, q.dtype) if t > 1 else None
    else:
        mask = meta.mask()
        mask = mask.repeat(1, 1, g, 1) if mask is not None else None
    o = F.scaled_dot_product_attention(q.reshape(b, kv, g * t, hd), keys, values, attn_mask=mask)
    return o.reshape(b, h, t, hd)


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention [1, KV, R, hd] over keys [1, KV, P, hd]: (output, log-sum-exp [1, KV, R]).

    On a CPU this is torch's fused flash kernel: with R = N budgets x m positions x group rows
    against an 8k prefix, plain ops stream a [KV, R, P] score matrix through memory five times
    per stage (SmolLM2 at 8k on two cores: 5.5 s per selection with plain ops, 1.3 s fused, same
    values to 3e-7). bf16 would be faster still (1.0 s) but changed 2 of 60 candidates.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, scale=scale)[:2]
        return out, lse
    return reference_prefix_attention(q, k, v, scale)


def reference_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in plain tensor ops (GPUs, and the check of the fused path in the tests)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    top = scores.amax(dim=-1, keepdim=True)
    weights = (scores - top).exp()
    total = weights.sum(dim=-1, keepdim=True)
    return (weights @ v) / total, (top + total.log()).squeeze(-1)
