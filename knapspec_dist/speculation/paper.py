"""``knapspec:paper``: the selection of the authors' code (kaist-flexml-lab/knapspec), on our
engine, so that its findings can be reproduced and compared with our default.

What it keeps from the authors (``self_speculation_strategy/knapspec.py`` and
``knapspec_generator.py``):

- reference positions: every committed token of the last m = 5 rounds (``PaperCadence``:
  states gathered in rounds 2..6 of each window of ``interval`` rounds), r of them (5 to 55);
- alpha: the raw top-1 agreement of a candidate with the full model over those r positions
  (``raw_alpha``; often 1.0), no prior and nothing learned from the run's drafts;
- draft length: always ``max_gamma`` = 10, ended by the confidence exit (tau_conf = 0.7,
  ``SelfSpeculative``); the Tokens-per-Time search only ranks the subnets (``rank``);
- re-selection: every ``interval`` = 64 rounds, the DP at round 7 of each window (after the
  fifth gathered round); ``select_once``: the first DP only;
- no margin and no guard: it always drafts with the best-ranked subnet.

It prices sublayers with our measured latency profile (the one the default resolves, in the
mode decoding runs in) instead of the authors' three linear coefficients; docs/paper-mode.md lists
the other departures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from knapspec_dist.engine.sequence import Batch
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.profiles.profile import LatencyProfile, integer_weights
from knapspec_dist.speculation import tpt
from knapspec_dist.speculation.dp import mean_context, plan_of, run_dp
from knapspec_dist.speculation.hidden_states import Reference
from knapspec_dist.speculation.knapspec import Decision, KnapsackSelector, KnapSpecConfig, Selection


def raw_alpha(agree: int, total: int) -> float:
    """The authors' acceptance estimate: the share of the r reference positions at which the
    candidate's top-1 token is the full model's."""
    return agree / total if total else 0.0


@dataclass(frozen=True)
class PaperCadence:
    """Rounds are counted from 1 (the first decode round after prefill, the authors' step 1).
    Within each window of ``interval`` rounds, rounds 2..m+1 keep the full model's hidden
    states and the DP runs when round m+2 is planned (the authors run it right after round
    m+1's verify: the same point of the run)."""

    interval: int = 64
    m: int = 5
    once: bool = False

    def gathers(self, round_: int) -> bool:
        """Whether round ``round_``'s verify keeps its hidden states."""
        if self.once and round_ > self.interval:
            return False
        return 2 <= round_ % self.interval <= self.m + 1

    def due(self, round_: int) -> bool:
        """Whether the DP runs when round ``round_`` is planned."""
        if self.once and round_ > self.interval:
            return False
        return round_ % self.interval == self.m + 2


def rank(alphas: Sequence[float], draft_times: Sequence[float], verify_time,
         max_gamma: int, objective: str) -> tpt.Choice:
    """The subnet to draft with, always at ``max_gamma`` (the confidence exit ends the draft):
    ranked by its best Tokens-per-Time over draft lengths 1..max_gamma (objective "tpt"), or by
    alpha alone ("alpha", the ablation). Plain decoding is never chosen when a candidate exists
    (no margin)."""
    best = tpt.search(alphas, draft_times, verify_time, max_gamma=max_gamma, allow_ar=False,
                      objective=objective)
    return tpt.Choice(best.candidate, max_gamma, best.tokens_per_time)


class PaperSelector(KnapsackSelector):
    """The authors' selection: the knapsack DP over r positions of the last m rounds, raw
    alphas, subnets ranked by TPT, draft length ``max_gamma`` with the confidence exit,
    re-selected every ``interval`` rounds, no margin, no guard."""

    def __init__(self, profiles: LatencyProfile | Sequence[LatencyProfile],
                 config: KnapSpecConfig = KnapSpecConfig()):
        super().__init__(profiles, config, kept_rounds=None)  # every round of the window
        self.cadence = PaperCadence(config.interval, config.m, config.select_once)

    def start(self, model: Transformer) -> None:
        super().start(model)
        self.round = 0
        self.gathering = False

    def wants_reference(self) -> bool:
        return self.gathering

    def decide(self, model: Transformer, batch: Batch) -> Decision:
        """Cadence (the DP at round m + 2 of each window), DP, raw alphas, rank; the plan is
        kept until the next DP."""
        self.profile = self.price(batch.size)
        self.round += 1
        if self.cadence.due(self.round):
            references = self.window(batch)
            if references:
                self.plan_now = self.select(model, batch, references).plan
            self.states = {}
        gathering = self.cadence.gathers(self.round)
        if gathering and not self.gathering:
            self.states = {}  # a new window: only consecutive positions up to each row's end
        self.gathering = gathering
        return Decision(self.plan_now)

    def select(self, model: Transformer, batch: Batch, references: list[Reference]
               ) -> Selection:
        """DP (weights: the measured latencies), raw alphas, ``rank``."""
        cfg, n, layers, p = self.config, mean_context(batch), model.cfg.num_layers, self.profile
        weights = integer_weights(p, n, layers, cfg.weight_cap)
        dp = run_dp(model, batch, references, weights, cfg)
        alphas = [raw_alpha(a, dp.positions) for a in dp.agree]
        if dp.candidates:
            choice = rank(alphas, [p.draft_time(c.skipped, n, layers) for c in dp.candidates],
                          lambda q: p.verify_time(q, n), cfg.max_gamma, cfg.objective)
        else:
            choice = tpt.Choice(None, 0, 1.0 / p.verify_time(1, n))
        return self.made(Selection(n, weights, dp.candidates, alphas, choice,
                                   plan_of(dp.candidates, choice), dp.positions))

    def window(self, batch: Batch) -> list[Reference]:
        """The references: every position the window kept, of up to ``reference_rows``
        rows, longest context first (the authors decode one row: all of its positions)."""
        found = []
        for slot, row in enumerate(batch.rows):
            states = self.states.get(row.rid)
            if states:
                found.append((batch.cache.lengths[slot], slot, states))
        found = sorted(found, key=lambda f: -f[0])[:self.config.reference_rows]
        flat = [(end, slot, [p for r in rounds for p in r]) for end, slot, rounds in found]
        return [Reference(slot, end - len(states), torch.stack(states, dim=1))
                for end, slot, states in flat]
