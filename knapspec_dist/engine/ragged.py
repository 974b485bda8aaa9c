"""A ragged verify: each row verifies its own number of tokens, in one forward.

A padded verify feeds every row the round's longest draft, so a batch where one row copies
eight tokens pays for eight on every row. On a CPU a forward's cost grows with its tokens
(at 1k, 16 rows of 3 tokens cost 1.56x a step, docs/measurements.md), and that padding is
what kept copied drafts out of batches. Here the rows' tokens go in as one forward of single
tokens (``ModelRunner.ragged``), and the logits come back as the padded verify's [B, q, V],
each row's slots past its own tokens a copy of its last (never judged), so acceptance reads
them as it reads any verify's.

Its attention is the dearer part: each token reads its row's keys on its own, where a padded
row's tokens read them together. So on a GPU, where a verify's cost is its key reads and not
its tokens, the padded one is cheaper; the round's price chooses (speculation/lookup.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.model.decoder import Capture
from knapspec_dist.model.paged_cache import PagedKVCache
from knapspec_dist.model.transfer import upload


@dataclass(frozen=True)
class RaggedTokens:
    """Per row its tokens to verify, the first at position ``lengths[b]``, flattened in row
    order: token i is row ``index[i]``'s at ``starts[i]``; ``gather`` [B, q] picks each row's
    slot j (its last token past its own) from the flat ones."""

    tokens: list[int]
    starts: list[int]
    index: list[int]
    gather: list[list[int]]

    @staticmethod
    def of(rows: list[list[int]], lengths: list[int]) -> RaggedTokens:
        tokens, starts, index, gather = [], [], [], []
        width = max(len(r) for r in rows)
        for b, (row, n) in enumerate(zip(rows, lengths)):
            first = len(tokens)
            tokens += row
            starts += range(n, n + len(row))
            index += [b] * len(row)
            gather.append([first + min(j, len(row) - 1) for j in range(width)])
        return RaggedTokens(tokens, starts, index, gather)


def ragged_verify(forward: ModelRunner, cache: PagedKVCache, rows: list[list[int]],
                  lengths: list[int], capture: Capture | None = None) -> torch.Tensor:
    """Logits [B, q, V] of each row's ``rows[b]`` (its pending token and drafts, 1 to q of
    them) at positions ``lengths[b]`` on, as a padded verify returns them; ``capture`` gets
    the hidden states as [B, q, d] too. One upload, no read-back."""
    plan = RaggedTokens.of(rows, lengths)
    n, dev = len(plan.tokens), forward.model.device
    packed = upload([plan.tokens + plan.starts + [i for g in plan.gather for i in g]], dev)[0]
    tokens, starts, gather = packed[:n, None], packed[n:2 * n], packed[2 * n:]
    inner = None if capture is None else Capture(capture.keep)
    logits = forward.ragged(tokens, plan.starts, cache, plan.index, capture=inner,
                            starts_dev=starts)
    shape = (len(rows), len(plan.gather[0]))
    if capture is not None:
        capture.extend(h[:, -1][gather].view(*shape, -1) for h in inner)
    return logits[:, -1][gather].view(*shape, -1)
