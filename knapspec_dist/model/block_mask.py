"""flex_attention's block masks, built on the device from each row's ``starts``: no host sync,
so a CUDA graph captures them.

A forward feeds T queries per row aligned to the end of the row's keys: query i of row b sees
logical keys ``0 .. starts[b] + i``. For query block qb (queries ``[qb*BS, min((qb+1)*BS, T))``)
key block kb is *full* when its last key is visible to the block's first query, ``(kb+1)*BS - 1
<= start + qb*BS``; the blocks from there up to the one holding the block's last visible key
``start + min((qb+1)*BS, T) - 1`` are *partial* (the mask_mod decides); later blocks are never
read. ``logical_blocks`` computes that once; the two masks differ only in where a logical
block lives:

- ``length_block_mask``: fixed slots, a row's keys are its own ``[capacity]`` positions, so a
  logical block is the physical one.
- ``paged_block_mask``: one pool of pages for all rows (model/paged_cache.py), the keys handed
  to flex are the whole pool (batch 1, broadcast over the rows), a page is one key block. The
  block table maps each row's logical block to its page; the mask_mod maps a physical key back
  to its logical position through the cache's inverse table (``logical``: page -> its block in
  the row that holds it) and checks the page is the row's. The fused kernel asks the mask_mod
  only on partial blocks, but flex's unfused path (eager, and dynamo without inductor) applies
  it to every key of the pool, so it must be the whole truth. The table's width is the row's
  most blocks, so the mask's shapes stay static while pages change hands between rounds, and
  graphs captured over it stay valid.
"""

from __future__ import annotations

import inspect

import torch
from torch.nn.attention.flex_attention import BlockMask

from knapspec_dist.model.attention import FLEX_BLOCK, canonical

# Torch 2.11 and later can skip the backward (q) indices of a BlockMask, which inference never
# reads: about a third of the ops of building one (gpu-check's ``block_mask_ops``).
SKIP_Q_BLOCKS = "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters

I32 = torch.int32


def logical_blocks(starts: torch.Tensor, t: int, kv_blocks: int, block: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(partial count [B, QB], partial indices [B, QB, kv_blocks], full count, full indices)
    in logical key blocks, by the rule of the module docstring."""
    q_blocks_n = -(-t // block)
    qb = torch.arange(q_blocks_n, device=starts.device)
    first_q = starts[:, None] + qb[None] * block  # [B, QB] position of each block's first query
    last_q = starts[:, None] + torch.clamp((qb[None] + 1) * block, max=t) - 1
    full = torch.clamp((first_q + 1) // block, max=kv_blocks)
    touched = torch.clamp(last_q // block + 1, max=kv_blocks)
    idx = torch.arange(kv_blocks, device=starts.device)
    full_idx = idx.expand(*full.shape, kv_blocks)
    partial_idx = torch.clamp(full[..., None] + idx, max=kv_blocks - 1)
    return touched - full, partial_idx, full, full_idx


def _from_kv_blocks(partial, partial_idx, full, full_idx, mask_mod, t: int, keys: int,
                    block: int, q_blocks: bool) -> BlockMask:
    skip = {"compute_q_blocks": False} if SKIP_Q_BLOCKS and not q_blocks else {}
    return BlockMask.from_kv_blocks(
        partial[:, None].to(I32), partial_idx[:, None].to(I32),
        full[:, None].to(I32), full_idx[:, None].to(I32),
        BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(t, keys), **skip)


def length_block_mask(starts: torch.Tensor, t: int, kv_len: int, block: int = FLEX_BLOCK, *,
                      q_blocks: bool = not SKIP_Q_BLOCKS) -> BlockMask:
    """The mask over fixed slots of ``kv_len`` positions. ``q_blocks``: also build the
    backward's indices (only gpu-check's ``block_mask_ops`` asks, to compare)."""
    starts = canonical(starts)  # a view into a round's packed upload: one stride, one guard
    blocks = logical_blocks(starts, t, -(-kv_len // block), block)
    torch._dynamo.mark_static(starts, 0)  # the mask_mod's closure: an integer batch (attention)

    def causal_to_end(b, h, q_idx, kv_idx):
        return kv_idx <= starts[b] + q_idx

    return _from_kv_blocks(*blocks, causal_to_end, t, kv_len, block, q_blocks)


def paged_block_mask(starts: torch.Tensor, t: int, table: torch.Tensor, logical: torch.Tensor,
                     page: int) -> BlockMask:
    """The mask over a page pool of ``logical.numel()`` pages of ``page`` positions: rows'
    block tables ``table`` [B, max_blocks] (their pages, in logical order), ``logical`` [pages]
    each page's block in its row. Needs torch's ``compute_q_blocks`` (2.11 and later): the
    backward's indices would be built over the row's blocks as if they were the pool's."""
    if not SKIP_Q_BLOCKS:
        raise RuntimeError("a paged flex mask needs torch 2.11 or later "
                           "(BlockMask.from_kv_blocks(compute_q_blocks=False))")
    starts = canonical(starts)
    partial, partial_idx, full, full_idx = logical_blocks(starts, t, table.shape[1], page)
    rows = table[:, None, :].expand(-1, partial.shape[1], -1)  # [B, QB, max_blocks]
    partial_idx, full_idx = rows.gather(2, partial_idx), rows.gather(2, full_idx)
    torch._dynamo.mark_static(starts, 0)

    def causal_to_end(b, h, q_idx, kv_idx):
        block = logical[kv_idx // page]
        mine = table[b, block] == kv_idx // page
        return mine & (block * page + kv_idx % page <= starts[b] + q_idx)

    return _from_kv_blocks(partial, partial_idx, full, full_idx, causal_to_end, t,
                           logical.numel() * page, page, False)
