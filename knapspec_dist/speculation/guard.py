"""The plan guard: between selections, drop a speculative plan that loses to plain decoding,
and keep the ratio of the acceptance the drafts realized to the one predicted.

A plan's drafts are priced by the profile at the acceptance actually seen; once they yield
fewer tokens per second than plain decoding the plan gives way to plain decoding until the
next selection (the guard that keeps the engine from staying slower than ``ar`` on a bad alpha
estimate). The realized/predicted acceptance ratio scales the best acceptance the spare rule
assumes a due DP could find (schedule.py); the candidates' own estimates are acceptance.py's.
Everything here counts and prices, never reads the wall clock, so every TP rank reaches the
same decision without a broadcast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from knapspec_dist.profiles.profile import LatencyProfile
from knapspec_dist.speculation.selfspec import Plan

log = logging.getLogger(__name__)


@dataclass
class PlanRun:
    """What the speculative plan in force has yielded, priced by the profile."""

    context: int
    alpha: float  # the acceptance the DP alone estimated for it (before this run's drafts)
    draft_time: float
    rounds: int = 0
    tokens: float = 0.0  # per row: accepted drafts plus the verifier's token, over all rounds
    modeled_s: float = 0.0

    GUARD_ROUNDS = 8  # judge a plan after this many draft/verify rounds

    def losing(self, profile: LatencyProfile) -> bool:
        """Slower than plain decoding at the acceptance actually seen."""
        if self.rounds < self.GUARD_ROUNDS:
            return False
        return self.tokens / self.modeled_s < 1.0 / profile.verify_time(1, self.context)


class PlanGuard:
    """Watches the plan in force (``run``) and keeps this run's accepted vs predicted drafts."""

    def __init__(self):
        self.run: PlanRun | None = None
        self.fallbacks = 0  # plans dropped for plain decoding (all runs)
        self.accepted = self.expected = 0.0

    def start(self) -> None:
        """A batch run begins: nothing in force, nothing seen."""
        self.run = None
        self.accepted = self.expected = 0.0

    @property
    def realized_ratio(self) -> float:
        """Realized over predicted acceptance of this run's drafts so far (1 before any;
        one pseudo-token on each side)."""
        return (self.accepted + 1.0) / (self.expected + 1.0)

    def watch(self, run: PlanRun | None) -> None:
        """The plan now in force (None: plain decoding, nothing to guard)."""
        self.run = run

    def record(self, drafts: int, verified: list[int], accepted: list[int],
               profile: LatencyProfile) -> None:
        """One round of the plan in force: ``drafts`` draft forwards; row b had ``verified[b]``
        drafts judged and kept ``accepted[b]``."""
        run = self.run
        if run is None or not drafts:
            return
        run.rounds += 1
        run.tokens += (sum(accepted) + len(accepted)) / len(accepted)
        run.modeled_s += drafts * run.draft_time + profile.verify_time(drafts + 1, run.context)
        self.accepted += sum(accepted)
        self.expected += run.alpha * sum(verified)

    def drops(self, plan: Plan, profile: LatencyProfile) -> bool:
        """Whether ``plan``, the one in force, now loses to plain decoding (then it is no
        longer watched and counts as a fallback)."""
        run = self.run
        if run is None or not run.losing(profile):
            return False
        log.info("plan %s gamma=%d yields %.2f tokens per round, below plain decoding at "
                 "this acceptance: plain decoding until the next selection",
                 sorted(plan.skip), plan.gamma, run.tokens / run.rounds)
        self.run = None
        self.fallbacks += 1
        return True
