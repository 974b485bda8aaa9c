"""The DP step every selector shares: the knapsack DP over the reference positions' hidden
states (knapsack.py, hidden_states.py), and each candidate's top-1 agreements with the full
model there."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Protocol

import torch

from knapspec_dist.engine.sequence import Batch
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.speculation import knapsack, tpt
from knapspec_dist.speculation.hidden_states import HiddenStateEvaluator, Reference
from knapspec_dist.speculation.selfspec import Plan


class DPConfig(Protocol):
    """The DP's settings (``knapspec.KnapSpecConfig`` has them)."""

    tau: float
    max_skip_fraction: float
    keep_first_last: bool
    coupled: bool


@dataclass(frozen=True)
class DP:
    """What one knapsack DP found: its candidates and, per candidate, the reference positions
    (of ``positions``) where its top-1 token is the full model's."""

    candidates: list[knapsack.Candidate]
    agree: list[int]
    positions: int


def mean_context(batch: Batch) -> int:
    """The context a selection prices a batch at: its rows' mean length."""
    return round(statistics.fmean(batch.lengths))


def run_dp(model: Transformer, batch: Batch, references: list[Reference], weights: list[int],
           config: DPConfig, useful_from: int = 1) -> DP:
    """The knapsack DP over ``references`` (knapsack.py, hidden_states.py), and each
    candidate's top-1 agreements with the full model there."""
    keep = (knapsack.first_and_last_layers(len(weights)) if config.keep_first_last
            else frozenset())
    evaluator = HiddenStateEvaluator(model, batch.cache, references)
    candidates = knapsack.solve(weights, evaluator, tau=config.tau,
                                max_skip_fraction=config.max_skip_fraction,
                                always_execute=keep, coupled=config.coupled,
                                useful_from=useful_from)
    return DP(candidates, agreements(model, evaluator, candidates),
              evaluator.reference.shape[1])


def agreements(model: Transformer, evaluator: HiddenStateEvaluator,
               candidates: list[knapsack.Candidate]) -> list[int]:
    """Per candidate, the reference positions where its top-1 token is the full model's."""
    if not candidates:
        return []
    reference = model.logits(evaluator.reference[-1]).argmax(dim=-1)  # [M]
    finals = torch.stack([evaluator.current[c.skipped_weight] for c in candidates])
    return (model.logits(finals).argmax(dim=-1) == reference).sum(dim=-1).tolist()


def reference_positions(references: list[Reference]) -> int:
    """r: the positions a DP over ``references`` judges on."""
    return sum(r.states.shape[1] for r in references)


def plan_of(candidates: list[knapsack.Candidate], choice: tpt.Choice) -> Plan:
    """The plan ``choice`` names (candidate None: plain decoding)."""
    skip = candidates[choice.candidate].skipped if choice.candidate is not None else frozenset()
    return Plan(skip, choice.gamma)
