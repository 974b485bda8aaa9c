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

from knapspec_dist.profiles.profile import LatencyProfile
from knapspec_dist.speculation import knapsack, tpt
from knapspec_dist.speculation.knapspec import KnapsackSelector, KnapSpecConfig


class ClaspSelector(KnapsackSelector):
    """Skips the layers whose removal keeps the hidden states closest to the full model's,
    ``skip_layers`` of them (a share of all layers), and drafts ``gamma`` tokens."""

    def __init__(self, profiles: LatencyProfile | Sequence[LatencyProfile], gamma: int,
                 skip_layers: float = 0.25, config: KnapSpecConfig = KnapSpecConfig()):
        """``config``: the DP's and the schedule's settings (its pricing ones are not used);
        CLaSp's skipping is always layer-level."""
        super().__init__(profiles, replace(config, coupled=True))
        self.gamma, self.skip_layers = gamma, skip_layers

    def weights(self, n: int, num_layers: int) -> list[int]:
        return [1] * (2 * num_layers)

    def choose(self, candidates: list[knapsack.Candidate], alphas: list[float], n: int,
               num_layers: int) -> tpt.Choice:
        """The candidate skipping closest to the target number of sublayers (ties: the higher
        acceptance), at the fixed gamma."""
        if not candidates:
            return tpt.Choice(None, 0, 0.0)
        target = 2 * round(self.skip_layers * num_layers)
        best = min(range(len(candidates)),
                   key=lambda k: (abs(len(candidates[k].skipped) - target), -alphas[k]))
        return tpt.Choice(best, self.gamma, 0.0)
