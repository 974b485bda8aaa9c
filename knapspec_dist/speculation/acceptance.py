"""What the run's drafts realized, per subnet: the default KnapSpec's acceptance estimate and
the draft length the confidence exit leaves.

A candidate's acceptance is a Beta posterior: a uniform (Laplace) prior (``prior``, its one
owner; ``smoothed_alpha`` is its mean after the DP's agreements alone), the DP's top-1
agreements over its r reference positions, and the rounds drafted so far with the subnet in
use and the subnets near it (weighted by the overlap of their skip sets, so evidence about a subnet
carries to the ones that differ from it by a sublayer or two). A round with row acceptance k
of c judged drafts is k successes and, when k < c, one failure (what follows a rejection is
never judged). The margin is this posterior's own spread (``Estimate.lower``), not a
constant. The confidence exit is learned the same way: each judged draft position is a trial,
a draft cut before gamma one exit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Estimate:
    """A Beta(a, b) posterior of a subnet's per-token acceptance."""

    a: float
    b: float

    @property
    def mean(self) -> float:
        return self.a / (self.a + self.b)

    @property
    def sd(self) -> float:
        s = self.a + self.b
        return math.sqrt(self.a * self.b / (s * s * (s + 1)))

    def lower(self, z: float) -> float:
        """The mean less ``z`` standard deviations, in [0, 1]."""
        return min(1.0, max(0.0, self.mean - z * self.sd))


def prior(agree: int, total: int) -> Estimate:
    """A uniform prior updated by ``agree`` of ``total`` top-1 matches: Beta(1 + agree,
    1 + total - agree).

    With m = 5 the raw ratio is 0 or 1 far too often; 5/5 becoming 6/7 keeps the TPT search
    from betting on ten-token drafts from five observations.
    """
    return Estimate(1.0 + agree, 1.0 + total - agree)


def smoothed_alpha(agree: int, total: int) -> float:
    """The acceptance ``agree`` of ``total`` top-1 matches estimate under the prior."""
    return prior(agree, total).mean


def similarity(x: frozenset[int], y: frozenset[int]) -> float:
    """Jaccard overlap of two skip sets (1 for the same subnet, 0 for disjoint ones)."""
    union = x | y
    return len(x & y) / len(union) if union else 1.0


@dataclass
class Tally:
    """The rounds drafted with one subnet: per row, accepted drafts, rejections, judged
    positions and exits."""

    accepted: int = 0
    rejected: int = 0
    judged: int = 0
    exits: int = 0


class AcceptanceBook:
    """Per subnet, what this run's draft rounds realized."""

    NEAR = 0.5  # subnets overlapping less than this lend no evidence

    def __init__(self):
        self.tallies: dict[frozenset[int], Tally] = {}

    def start(self) -> None:
        self.tallies = {}

    def record(self, skip: frozenset[int], gamma: int, verified: list[int],
               accepted: list[int]) -> None:
        """One round drafted with ``skip`` at draft length ``gamma``."""
        t = self.tallies.setdefault(frozenset(skip), Tally())
        for v, k in zip(verified, accepted):
            if not v:
                continue
            t.accepted += k
            t.rejected += k < v
            t.judged += v
            t.exits += v < gamma

    def estimate(self, skip: frozenset[int], agree: int, positions: int) -> Estimate:
        """Uniform prior, the DP's ``agree`` of ``positions``, and the realized rounds of the
        subnets near ``skip``."""
        start = prior(agree, positions)
        a, b = start.a, start.b
        for other, t in self.tallies.items():
            w = similarity(skip, other)
            if w >= self.NEAR:
                a += w * t.accepted
                b += w * t.rejected
        return Estimate(a, b)

    @property
    def exit_rate(self) -> float:
        """Per judged draft position, the chance the confidence exit ends the draft there
        (one pseudo-trial without an exit: 0 before any draft)."""
        judged = sum(t.judged for t in self.tallies.values())
        exits = sum(t.exits for t in self.tallies.values())
        return exits / (judged + 1)


def fit_acceptance(book: AcceptanceBook, candidates, agree: list[int], positions: int,
                   z: float) -> tuple[list[float], list[float]]:
    """Per candidate (a ``knapsack.Candidate``), the acceptance it is chosen by: the
    posterior mean of the DP's ``agree`` of ``positions`` and this run's drafts with it and
    with the subnets near it (``book``), and that mean less ``z`` of its spread (the margin)."""
    estimates = [book.estimate(c.skipped, a, positions) for c, a in zip(candidates, agree)]
    return [e.mean for e in estimates], [e.lower(z) for e in estimates]
