"""Drafts copied from a row's own tokens (prompt-lookup decoding), priced by Tokens-per-Time.

A summary copies from its document: names, terms, phrases. Where the last few tokens of a
row (prompt and output so far) occurred before in it, the tokens that followed then are a
draft that costs no forward pass at all. One verify judges them like any draft, so the
output is what plain decoding gives (greedy, coupled sampling; under rejection sampling a
copied token is a proposal of probability 1, kept with the target's probability).

- **The index** (``TokenIndex``): per row, for each n in ``MIN_N .. MAX_N``, the position
  that followed the latest earlier occurrence of every n-gram of its tokens. Built when the
  row first decodes, extended by each committed token, so a lookup is O(n), never a scan;
  it lives beside the rows in the replica, nothing of it crosses Ray.
- **The acceptance** (``CopyBook``): per match length, a Beta posterior of the chance that
  each copied token is accepted after the ones before it, from this run's verifies (as the
  subnets' acceptance is learned, acceptance.py), and from the copies a round did not draft:
  each is judged against the tokens the row then commits (``Shadow``), which are what a
  verify would have kept (greedy and coupled sampling; under rejection sampling a committed
  token equals a copy with the probability a verify keeps it). So a batch whose price at the
  prior's lower bound forbids copies still learns what they would yield, at no cost.
- **The price** (``best_round``): a round verifies ``q`` tokens a row; a row drafts
  ``min(its copy, q - 1)`` and is expected to yield ``tpt.expected_tokens``; the round's
  tokens over the verify's priced seconds at this batch and context, against plain decoding
  (and against the selected subnet's predicted rate: selfspec.py), at the posterior's lower
  bound too (the estimate's noise), as the subnets' choice is made.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from knapspec_dist.speculation import tpt

MAX_N = 3  # the longest n-gram matched
MIN_N = 2  # the shortest (a single token recurs too often to predict what follows)
MAX_COPY = 8  # copied tokens a row drafts at most in one round
PRIOR = (1.0, 1.0)  # Beta prior of a copied token's acceptance: uniform, as a subnet's


class TokenIndex:
    """One row's tokens, and for each n-gram of them the position after its latest earlier
    occurrence. An n-gram enters once the token after it exists, so the row's current
    suffix finds an earlier occurrence, never itself."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: list[int] = []
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in
                                                             range(MIN_N, MAX_N + 1)}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the n-grams ending just before it now have a next
            for n, table in self.after.items():
                if end >= n:
                    table[tuple(self.tokens[end - n:end])] = end

    def propose(self, limit: int = MAX_COPY) -> tuple[list[int], int]:
        """(up to ``limit`` tokens that followed the latest earlier occurrence of the longest
        suffix matched, its length n); ([], 0) where no suffix of ``MIN_N`` tokens recurs."""
        for n in range(MAX_N, MIN_N - 1, -1):
            if len(self.tokens) < n:
                continue
            at = self.after[n].get(tuple(self.tokens[-n:]))
            if at is not None:
                return self.tokens[at:at + limit], n
        return [], 0


@dataclass
class CopyBook:
    """Per match length n, copied tokens judged and accepted in this run; a copied token is
    judged while the ones before it were accepted (a row's verify of k copied tokens that kept
    a judges a + 1 of them, or k when all were kept)."""

    judged: dict[int, int] = field(default_factory=dict)
    kept: dict[int, int] = field(default_factory=dict)

    def record(self, n: int, verified: int, accepted: int) -> None:
        if n and verified:
            self.judged[n] = self.judged.get(n, 0) + min(accepted + 1, verified)
            self.kept[n] = self.kept.get(n, 0) + accepted

    def alpha(self, n: int, noise_z: float = 0.0) -> float:
        """The posterior mean of a copied token's acceptance at match length n, less
        ``noise_z`` of its standard deviations."""
        a = PRIOR[0] + self.kept.get(n, 0)
        b = PRIOR[1] + self.judged.get(n, 0) - self.kept.get(n, 0)
        mean = a / (a + b)
        sd = math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))
        return min(1.0, max(0.0, mean - noise_z * sd))

    @property
    def drafted(self) -> int:
        return sum(self.judged.values())


@dataclass(frozen=True)
class CopiedRound:
    """What a round of copied drafts verifies: per row its drafts (``drafts[b]``, possibly
    none), the match length each came from, and the round's verify length q (one more than
    the longest drafts). ``ragged``: each row verifies its own tokens only
    (engine/ragged.py); else every row is padded to q."""

    drafts: list[list[int]]
    matches: list[int]
    q: int
    tokens_per_s: float  # what the price predicted for the batch
    ragged: bool = False

    @property
    def tokens(self) -> int:
        """Tokens the verify feeds the model."""
        size = len(self.drafts)
        return size + sum(len(d) for d in self.drafts) if self.ragged else size * self.q


@dataclass(frozen=True)
class VerifyPrices:
    """A verify's priced seconds at the round's batch and context: ``padded(q)`` with every
    row fed q tokens; ``ragged(x)`` with the rows fed x tokens each on average, each fed its
    own (None: this cache cannot verify ragged)."""

    padded: Callable[[float], float]
    ragged: Callable[[float], float] | None = None


def best_round(proposals: Sequence[tuple[list[int], int]], book: CopyBook,
               prices: VerifyPrices, rival_rate: float, min_gain: float,
               noise_z: float) -> CopiedRound | None:
    """The copied drafts that yield the most tokens per second for the batch, if that beats
    ``rival_rate`` (the batch's tokens per second without copies: plain decoding, or the
    subnet's plan) by ``min_gain`` at the acceptance estimates and at their lower bounds too;
    None otherwise. Padded, a verify length q (2 .. 1 + the longest copy) cuts every row's
    copy to q - 1; ragged, each row drafts what its copy is worth (``ragged_drafts``)."""
    longest = max((len(d) for d, _ in proposals), default=0)
    if not longest:
        return None

    def tokens(lengths: Sequence[int], z: float) -> float:
        return sum(tpt.expected_tokens(book.alpha(n, z), k) if k else 1.0
                   for (_, n), k in zip(proposals, lengths))

    def padded(q: int) -> list[int]:
        return [min(len(d), q - 1) for d, _ in proposals]

    size = len(proposals)
    options = [(k, tokens(k, 0.0), prices.padded(q), False)
               for q in range(2, longest + 2) for k in [padded(q)]]
    if prices.ragged is not None:
        order, yields = ragged_drafts(proposals, book)
        m = max(range(1, len(order) + 1),
                key=lambda m: yields[m - 1] / prices.ragged(1 + m / size))
        lengths = [0] * size
        for b in order[:m]:
            lengths[b] += 1
        options.append((lengths, yields[m - 1], prices.ragged(1 + m / size), True))
    lengths, expected, seconds, ragged = max(options, key=lambda o: (o[1] / o[2], -o[2]))
    best = expected / seconds
    if best < min_gain * rival_rate or tokens(lengths, noise_z) / seconds < min_gain * rival_rate:
        return None
    return CopiedRound([d[:k] for (d, _), k in zip(proposals, lengths)],
                       [n for _, n in proposals], 1 + max(lengths), best, ragged)


def ragged_drafts(proposals: Sequence[tuple[list[int], int]], book: CopyBook
                  ) -> tuple[list[int], list[float]]:
    """The rows' copied tokens in the order they are drafted, one more at a time (the row
    each goes to), and the batch's expected yield after each: the next token is the one
    expected to add the most (a row's k-th copied token adds alpha^k), so the first m of
    them are the m tokens that yield the most."""
    gains = sorted(((book.alpha(n) ** k, -k, b) for b, (d, n) in enumerate(proposals)
                    for k in range(1, len(d) + 1)), reverse=True)
    expected, yields = float(len(proposals)), []
    for gain, _, _ in gains:
        expected += gain
        yields.append(expected)
    return [b for _, _, b in gains], yields


@dataclass(frozen=True)
class Shadow:
    """A copy a round did not draft: ``tokens`` proposed from match length ``n`` for the
    row's positions from ``start`` on, judged once the row has committed enough of them."""

    start: int
    tokens: list[int]
    n: int

    def judged(self, committed: Sequence[int]) -> tuple[int, int] | None:
        """(copied tokens a verify would have judged, kept) against the tokens the row
        committed from ``start`` on; None while they do not yet decide it."""
        kept = 0
        for copy, token in zip(self.tokens, committed):
            if copy != token:
                return len(self.tokens), kept
            kept += 1
        return (len(self.tokens), kept) if kept == len(self.tokens) else None


class CopiedDrafts:
    """The copied drafts of a run: each decoding row's index, and what this run learned of
    their acceptance."""

    def __init__(self, min_gain: float = 1.05, noise_z: float = 1.0):
        self.min_gain, self.noise_z = min_gain, noise_z
        self.indexes: dict[int, TokenIndex] = {}
        self.shadows: dict[int, Shadow] = {}  # per row, its copy not drafted, being judged
        self.book = CopyBook()

    def start(self) -> None:
        self.indexes, self.shadows = {}, {}  # the book is kept: copies' acceptance is the
        # text's, not the run's

    def retire(self, rid: int) -> None:
        self.indexes.pop(rid, None)
        self.shadows.pop(rid, None)

    def proposals(self, rows, room: Sequence[int]) -> list[tuple[list[int], int]]:
        """Each row's copy (at most ``room[b]`` tokens), its index brought up to date."""
        out = []
        for row, space in zip(rows, room):
            index = self.indexes.get(row.rid)
            if index is None:
                index = self.indexes[row.rid] = TokenIndex(row.prompt + row.out)
            else:
                index.extend(row.out[len(index.tokens) - len(row.prompt):])
            self.judge_shadow(row.rid, index)
            out.append(index.propose(min(MAX_COPY, space)) if space > 0 else ([], 0))
        return out

    def judge_shadow(self, rid: int, index: TokenIndex) -> None:
        """Record the row's undrafted copy in the book once its committed tokens decide it."""
        shadow = self.shadows.get(rid)
        if shadow is not None:
            judged = shadow.judged(index.tokens[shadow.start:])
            if judged is not None:
                self.book.record(shadow.n, *judged)
                del self.shadows[rid]

    def plan(self, rows, room: Sequence[int], prices: VerifyPrices,
             rival_rate: float) -> CopiedRound | None:
        """This round's copied drafts, where they price better than ``rival_rate``; where
        not, each row's copy is judged later against what it commits (``Shadow``)."""
        proposals = self.proposals(rows, room)
        chosen = best_round(proposals, self.book, prices, rival_rate, self.min_gain,
                            self.noise_z)
        if chosen is None:
            for row, (tokens, n) in zip(rows, proposals):
                if tokens and row.rid not in self.shadows:
                    start = len(row.prompt) + len(row.out)  # the copy's first position
                    self.shadows[row.rid] = Shadow(start, tokens, n)
        return chosen

    def record(self, copied: CopiedRound, verified: list[int], accepted: list[int]) -> None:
        for n, v, a in zip(copied.matches, verified, accepted):
            self.book.record(n, v, a)
