"""CLaSp, the layer-skipping baseline: the same DP over hidden states, but layer-level (a
layer's attention and MLP skipped together), every layer weighing the same, a fixed share of
the layers skipped and a fixed draft length, re-selected every interval.

It prices nothing, so no due selection is spared and no plan is guarded: it drafts whatever
its subnet yields. The latency profile only sets how far the interval stretches while a DP is
slow next to decoding (schedule.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from knapspec_dist.engine.sequence import Batch
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.profiles.profile import LatencyProfile
from knapspec_dist.speculation import knapsack, tpt
from knapspec_dist.speculation.acceptance import smoothed_alpha
from knapspec_dist.speculation.dp import mean_context, plan_of, run_dp
from knapspec_dist.speculation.hidden_states import Reference
from knapspec_dist.speculation.knapspec import Decision, KnapsackSelector, KnapSpecConfig, Selection


def closest_to(candidates: list[knapsack.Candidate], alphas: list[float], target: int,
               gamma: int) -> tpt.Choice:
    """The candidate skipping closest to ``target`` sublayers (ties: the higher acceptance),
    at the fixed ``gamma`` (none: plain decoding)."""
    if not candidates:
        return tpt.Choice(None, 0, 0.0)
    best = min(range(len(candidates)),
               key=lambda k: (abs(len(candidates[k].skipped) - target), -alphas[k]))
    return tpt.Choice(best, gamma, 0.0)


class ClaspSelector(KnapsackSelector):
    """Skips the layers whose removal keeps the hidden states closest to the full model's,
    ``skip_layers`` of them (a share of all layers), and drafts ``gamma`` tokens."""

    def __init__(self, profiles: LatencyProfile | Sequence[LatencyProfile], gamma: int,
                 skip_layers: float = 0.25, config: KnapSpecConfig = KnapSpecConfig()):
        """``config``: the DP's and the schedule's settings (its pricing ones are not used);
        CLaSp's skipping is always layer-level."""
        super().__init__(profiles, replace(config, coupled=True), kept_rounds=config.m)
        self.gamma, self.skip_layers = gamma, skip_layers

    def decide(self, model: Transformer, batch: Batch) -> Decision:
        """Cadence, DP; the plan is kept until the next (nothing spared, nothing guarded)."""
        self.profile = self.price(batch.size)
        if self.due(batch):
            self.plan_now = self.clocked(self.select, model, batch)
        return self.decision()

    def select(self, model: Transformer, batch: Batch, references: list[Reference]
               ) -> Selection:
        """DP (every layer weighing the same), smoothed alphas, the subnet nearest the share."""
        n, layers = mean_context(batch), model.cfg.num_layers
        weights = [1] * (2 * layers)
        dp = run_dp(model, batch, references, weights, self.config)
        alphas = [smoothed_alpha(a, dp.positions) for a in dp.agree]
        choice = closest_to(dp.candidates, alphas, 2 * round(self.skip_layers * layers),
                            self.gamma)
        return self.made(Selection(n, weights, dp.candidates, alphas, choice,
                                   plan_of(dp.candidates, choice), dp.positions))
