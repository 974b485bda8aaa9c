"""Batch buckets: a forward of B rows runs as one of a few padded batch sizes.

Compiled flex attention has a static batch (model/attention.py: torch's flex-decoding kernel
needs an integer batch), so each batch size is a compile, and under continuous batching the
batch takes every value from 1 to ``max_num_seqs``. Padded up to the next power of two (capped
at the rows the cache has), it takes only log2(max_num_seqs) + 1 values.

A padded row is a real cache row past the batch (the row being prefilled, or a free one). It
writes its K/V at its own length, ``max(length, 1)`` (past every valid position, which the
cache never reads before rewriting), attends only to its own row, and its logits and hidden
states are dropped: the real rows' results do not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.decoder import Capture


def bucket(rows: int, limit: int) -> int:
    """The padded batch for ``rows`` rows: the next power of two, at most ``limit``."""
    return max(rows, min(1 << max(0, rows - 1).bit_length(), limit))


def buckets(limit: int) -> list[int]:
    """Every batch size ``bucket`` gives for 1 .. ``limit`` rows."""
    return sorted({bucket(n, limit) for n in range(1, limit + 1)})


def pad_starts(starts: Sequence[int], lengths: Sequence[int], t: int,
               capacity: int) -> list[int] | None:
    """The starts of the real rows followed by each padded row's (``lengths``: the padded
    rows' cache lengths), or None where a padded row has no room for ``t`` positions past
    its length (then the forward runs unpadded)."""
    pads = [max(n, 1) for n in lengths]
    if any(p + t > capacity for p in pads):
        return None
    return list(starts) + pads


def padded_forward(forward: Callable, tokens: torch.Tensor, starts: Sequence[int],
                   cache: KVCache, rows: slice | None, capture: Capture | None,
                   **kwargs) -> torch.Tensor | None:
    """``forward(tokens, starts, cache, rows, capture=..., **kwargs)`` over the batch padded
    to its bucket, its logits and captured states cut back to the real rows; None where no
    padding applies (``rows`` already a bucket, or no room), and the caller runs it as is."""
    b, t = tokens.shape
    rows = rows if rows is not None else slice(0, b)
    size = bucket(b, cache.batch - rows.start)
    if size == b or isinstance(starts, torch.Tensor):
        return None
    padded = pad_starts(starts, cache.lengths[rows.start + b:rows.start + size], t,
                        cache.capacity)
    if padded is None:
        return None
    tokens = torch.cat([tokens, tokens[-1:].expand(size - b, t)])
    inner = None if capture is None else Capture(capture.keep)
    logits = forward(tokens, padded, cache, slice(rows.start, rows.start + size),
                     capture=inner, **kwargs)
    if capture is not None:
        capture.extend(h[:b] for h in inner)
    return logits[:b]
