"""The rows a replica is decoding together, and where each one lives in the KV cache.

Decoding rows occupy cache rows ``0 .. B-1`` in order, so a round is one forward over the
slice ``0:B`` (no gather, no padding). A row being prefilled sits at slot B until its prompt is
in, then joins. A finished row leaves by moving the last decoding row into its slot (fixed
slots: K/V up to that row's length, once per finished row; paged: its block-table row); a row
being prefilled then moves down too. Lengths live on the host (``cache.lengths``): the decode loop
knows them from the one read-back per round, and uploads them with the pending tokens, seeds
and output indices in one copy per round (``Batch.inputs``); every forward's positions are
made from that on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from knapspec_dist.engine.generation import GenerationStats
from knapspec_dist.engine.pages import PagePool
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.paged_cache import PagedKVCache
from knapspec_dist.model.transfer import upload
from knapspec_dist.option_rules import MAX_GAMMA  # the longest draft, a rule of --gamma


def row_capacity(prompt_len: int, limit: int) -> int:
    """Cache positions one row needs: prompt, new tokens, and room for a draft past the end."""
    return prompt_len + limit + MAX_GAMMA + 2


@dataclass
class Row:
    """One sequence being generated."""

    rid: int  # the caller's id
    prompt: list[int]
    limit: int  # new tokens allowed
    seed: int = 0  # the row's own randomness (sampling.row_seed): tokens never depend on others
    out: list[int] = field(default_factory=list)  # emitted; the last is not yet in the cache
    reason: str | None = None  # "eos" | "length" once finished
    prefilled: int = 0  # prompt tokens already in the cache
    stats: GenerationStats = field(default_factory=GenerationStats)
    admitted_s: float = 0.0
    finished_s: float = 0.0


@dataclass(frozen=True)
class RoundInputs:
    """A round's per-row numbers on the device, [B] int64 each (one pinned, non-blocking copy:
    the round's only upload; everything else it needs is made on the device)."""

    pending: torch.Tensor  # [B, 1] the last emitted token, not yet in the cache
    starts: torch.Tensor  # the cache length: where the pending token goes
    seeds: torch.Tensor  # the row's randomness (sampling.row_seed)
    index: torch.Tensor  # the output index of the row's next token
    room: torch.Tensor  # drafts the row can still use before its limit


@dataclass
class Batch:
    cache: KVCache | PagedKVCache
    rows: list[Row] = field(default_factory=list)  # decoding, in cache-row order
    prefilling: Row | None = None  # at slot len(rows)
    progress: float = 0.0  # tokens emitted per decoding row, summed over rounds
    pool: PagePool | None = None  # a paged cache's pages; None: fixed slots

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths[:len(self.rows)]

    def inputs(self, device) -> RoundInputs:
        """What a round needs of each decoding row on ``device``, in one upload."""
        packed = upload([[r.out[-1], n, r.seed, len(r.out), max(r.limit - len(r.out) - 1, 0)]
                         for r, n in zip(self.rows, self.lengths)], device)
        return RoundInputs(packed[:, :1], *packed[:, 1:].unbind(1))

    def join(self) -> None:
        """The prefilled row starts decoding (it already sits at slot len(rows))."""
        self.rows.append(self.prefilling)
        self.prefilling = None

    def free(self, slot: int) -> None:
        """A row left ``slot``: its length back to 0 and, paged, its pages back to the pool."""
        if self.pool is not None:
            self.pool.release(slot)
        else:
            self.cache.commit(slot, 0)

    def retire(self, finished: list[Row]) -> None:
        """Drop finished rows, keeping the others packed at slots 0..B-1."""
        for row in finished:
            i = self.rows.index(row)
            last = len(self.rows) - 1
            self.free(i)
            if i != last:
                self.cache.move_row(last, i)
                self.rows[i] = self.rows[last]
            self.rows.pop()
            if self.prefilling is not None:
                self.cache.move_row(last + 1, last)
            self.cache.commit(last + (self.prefilling is not None), 0)

