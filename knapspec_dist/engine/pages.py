"""The block manager of a paged KV cache: which pages each row holds.

A row is given every page it can need when it is admitted (its prompt, its new tokens and the
draft lookahead: ``row_capacity``) and gives them all back when it ends, so the decode loop
never allocates, never runs out and never preempts, and a rejected draft keeps its pages. A row
gets the lowest run of consecutive free pages that holds it, where there is one, else the
lowest free pages: on a CPU a row on consecutive pages is read in place, not gathered
(model/paged_cache.py). The same admissions give the same pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from knapspec_dist.model.attention import FLEX_BLOCK
from knapspec_dist.model.paged_cache import SCRATCH, PagedKVCache

CPU_PAGE = 16  # positions per page under sdpa: the gather indexes positions, so the page size
# changes only the block table's width and the waste, at most page - 1 positions a row
FLEX_PAGE = FLEX_BLOCK  # under flex: one page is one key block of the block mask


def page_size(backend: str) -> int:
    """Positions per page for an attention backend (model/attention.py)."""
    return FLEX_PAGE if backend == "flex" else CPU_PAGE


def pages_for(tokens: int, page: int) -> int:
    """Pages that hold ``tokens`` positions."""
    return -(-tokens // page)


@dataclass(frozen=True)
class Paging:
    """A paged cache's size: a pool of ``tokens`` positions in pages of ``page``."""

    tokens: int
    page: int = CPU_PAGE

    @property
    def n_pages(self) -> int:
        """Pages of the pool, the scratch page included."""
        return -(-self.tokens // self.page) + 1


class PagePool:
    """The free pages of one paged cache (every row empty when it starts), and the rows'."""

    def __init__(self, cache: PagedKVCache):
        if any(cache.pages):
            raise ValueError("a page pool starts on a cache whose rows are all empty")
        self.cache = cache
        self.free: list[int] = [p for p in range(cache.n_pages) if p != SCRATCH]  # sorted
        self.total = len(self.free)

    @property
    def page(self) -> int:
        return self.cache.page

    @property
    def tokens(self) -> int:
        """Positions the pool holds, the scratch page aside."""
        return self.total * self.page

    def pages_for(self, tokens: int) -> int:
        return pages_for(tokens, self.page)

    def fits(self, tokens: int) -> bool:
        """Whether the free pages cover a row of ``tokens`` positions now."""
        return self.pages_for(tokens) <= len(self.free)

    def admit(self, row: int, tokens: int) -> None:
        """Reserve ``tokens`` positions for an empty cache row."""
        n = self.pages_for(tokens)
        if n > len(self.free):
            raise ValueError(f"{n} pages asked, {len(self.free)} free")
        self.cache.assign(row, self._take(n))

    def _take(self, n: int) -> list[int]:
        """The lowest run of ``n`` consecutive free pages, else the ``n`` lowest free pages."""
        free = np.asarray(self.free)
        ends = np.flatnonzero(np.diff(free) != 1) + 1  # where each run of the free pages ends
        starts = np.concatenate(([0], ends))
        runs = np.flatnonzero(np.concatenate((ends, [len(free)])) - starts >= n)
        at = int(starts[runs[0]]) if len(runs) else 0  # no run: the lowest pages, from 0
        taken = self.free[at:at + n]
        del self.free[at:at + n]
        return taken

    def release(self, row: int) -> None:
        """A row ended: its pages are free again and its cache row empty."""
        self.free = sorted(self.free + self.cache.release(row))

    @property
    def reserved(self) -> int:
        """Pages the rows hold."""
        return sum(len(p) for p in self.cache.pages)


@dataclass
class KVUse:
    """How a scheduler used its KV cache: the most positions reserved at once (a fixed slot
    counts whole), the most rows in flight at once (decoding or prefilling), and the seconds
    the head of the queue waited for memory with a slot free (``waited``: the rows admitted
    after such a wait). Merged over calls and replicas: peaks by max, the rest summed."""

    peak_tokens: int = 0
    peak_rows: int = 0
    wait_s: float = 0.0
    waited: int = 0

    def merge(self, other: KVUse) -> KVUse:
        return KVUse(max(self.peak_tokens, other.peak_tokens),
                     max(self.peak_rows, other.peak_rows), self.wait_s + other.wait_s,
                     self.waited + other.waited)
