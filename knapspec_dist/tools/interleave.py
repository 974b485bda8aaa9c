"""The run order of interleaved repeats, shared by the benchmarks."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def interleaved(items: list[T], repeats: int) -> list[tuple[int, T]]:
    """(repeat, item) in run order: every item once per repeat, the order rotating by one
    from repeat to repeat, so that a slow spell of the machine is shared out, not borne by
    one item."""
    n = len(items)
    return [(r, items[(r + k) % n]) for r in range(repeats) for k in range(n)]
