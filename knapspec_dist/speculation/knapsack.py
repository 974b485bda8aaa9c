"""KnapSpec's knapsack DP over the 2L sublayers, free of tensors.

Items are the sublayers in execution order: item ``2*l`` is the Attention of layer ``l``,
item ``2*l + 1`` its MLP. ``g[i][j]`` is the best hidden state after item ``i`` having
skipped a total integer weight of exactly ``j``. The solver only sees budgets and scores;
the hidden states live with the caller (a :class:`StageEvaluator`), so the DP runs where
the tensors are and every budget of a stage is scored in one batched call.

State ids
---------
The ids passed to ``evaluate`` (``sources``) and used as keys of ``keep``'s ``chosen`` are
budgets ``j >= 0`` (skipped weight so far). The one exception is coupled mode (below),
which adds negative ids for "attention skipped, MLP pending" states. A caller that treats
ids as opaque dictionary keys works in both modes.

Coupled mode (layer-level skipping)
-----------------------------------
With ``coupled=True`` a layer's Attention and MLP are skipped together. Skipping both is
the identity on the layer input, but the decision cannot be resolved at the Attention
stage: "execute attention from budget j + w_a" and "skip attention from budget j" land on
the same skipped weight yet end the layer at different budgets, so keeping only the best
of them would lose the optimum. The stage after an Attention item therefore carries two
kinds of states:

* executed states with id ``j`` (attention executed on stage-(i-1) budget ``j``), and
* attention-skipped states with id ``-(j + 1)`` (the stage-(i-1) budget ``j`` state
  passed through unchanged; if it survives, the MLP stage skips the MLP too and the
  state ends the layer at budget ``j + w_a + w_m``).

At the MLP stage, executed ids (``>= 0``) are the sources of ``execute=True`` and the
negative ids are the sources of ``execute=False``; every final state after the MLP is a
plain budget again. ``evaluate`` is still called once per (item, execute), and backtracking
is the same walk over the recorded choices in both modes. Pruning applies at every stage,
attention-skipped states included (scored against the full model after the attention).

Useful budgets
--------------
``useful_from`` > 1 says that only final budgets of at least that weight can be of use (the
caller knows that a subnet skipping less cannot pay for its drafts). A state that cannot reach
it, even by skipping every skippable item still ahead, is dropped; its successors could not
reach it either, so the candidates returned are exactly those of the full DP at or above
``useful_from``, for fewer evaluations. Once no state can reach it the DP stops.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One draft subnet: the sublayers it skips and the DP's score for it."""

    skipped: frozenset[int]  # item indices skipped
    skipped_weight: int  # sum of integer weights of skipped items (the budget j)
    value: float  # the DP's value (mean cosine) of the final state


class StageEvaluator(Protocol):
    """Owned by the caller (holds hidden-state tensors); the solver only sees budgets and scores."""

    def evaluate(self, item: int, sources: list[int], execute: bool) -> list[float]:
        """Value (e.g. mean cosine vs the full model after `item`) of the states obtained from the
        stage-(item-1) states at budgets `sources` by executing (execute=True) or skipping item
        `item`.
        One call per (item, execute) so the caller can run all budgets in one batched forward."""
        ...

    def keep(self, item: int, chosen: dict[int, tuple[int, bool]]) -> None:
        """Stage `item` is final: budget j's state comes from stage item-1's budget chosen[j][0],
        executed if chosen[j][1]. Budgets absent from `chosen` were pruned.
        In coupled mode ids may be negative: see "Coupled mode" in the module docstring."""
        ...


@dataclass(frozen=True)
class _Move:
    """One transition of a stage: from source id `source` to state id `target`."""

    source: int
    target: int
    execute: bool


def solve(
    weights: Sequence[int],
    evaluator: StageEvaluator,
    *,
    tau: float = 0.5,
    max_skip_fraction: float = 0.5,
    always_execute: Collection[int] = (),
    coupled: bool = False,
    useful_from: int = 1,
) -> list[Candidate]:
    """Run the DP over all items; return one candidate per reachable final budget
    j >= max(1, useful_from), sorted by j.

    Ties between executing and skipping go to executing (the cheaper-to-trust, more accurate
    state). States with value < tau are pruned, except the all-executed state (id 0), which is
    kept so every stage has a source, unless it cannot reach ``useful_from`` (module
    docstring). NaN values count as -inf.
    """
    weights = [int(w) for w in weights]
    _check(weights, max_skip_fraction, always_execute, coupled)
    cap = skip_cap(weights, max_skip_fraction)
    useful_from = max(1, useful_from)
    forced = set(always_execute)
    if coupled:  # a layer is skippable only if both its sublayers are
        forced |= {i ^ 1 for i in forced}
    ahead = _skippable_ahead(weights, forced)

    values: dict[int, float] = {0: 1.0}  # stage -1: the input state
    history: list[dict[int, tuple[int, bool]]] = []
    if useful_from > cap:
        return []
    for item, weight in enumerate(weights):
        if not values:
            return []  # no state can reach a useful budget: nothing left to evaluate
        moves = _moves(item, weights, values, cap=cap, skippable=item not in forced,
                       coupled=coupled)
        scored = _score(item, moves, evaluator)
        chosen, values = _select(moves, scored, tau)
        for s in [s for s in chosen if _reach(s, item, weights, ahead) < useful_from]:
            del chosen[s], values[s]
        evaluator.keep(item, chosen)
        history.append(chosen)
        logger.debug("knapsack item %d (w=%d): %d states kept", item, weight, len(values))

    candidates = [
        Candidate(skipped=_backtrack(history, j), skipped_weight=j, value=v)
        for j, v in sorted(values.items())
        if j >= useful_from
    ]
    logger.debug("knapsack: %d candidates, cap %d, coupled=%s", len(candidates), cap, coupled)
    return candidates


def first_and_last_layers(items: int) -> frozenset[int]:
    """The sublayers of the first and the last layer (of ``items`` = 2L), which a DP with
    ``keep_first_last`` always executes."""
    return frozenset({0, 1, items - 2, items - 1})


class _Counting:
    """A stage evaluator that scores every state alike and counts the states each item
    executes on: the DP's work with no state pruned by ``tau``."""

    def __init__(self):
        self.executed: list[tuple[int, int]] = []

    def evaluate(self, item: int, sources: list[int], execute: bool) -> list[float]:
        if execute:
            self.executed.append((item, len(sources)))
        return [1.0] * len(sources)

    def keep(self, item: int, chosen: dict[int, tuple[int, bool]]) -> None:
        pass


def executed_states(weights: Sequence[int], *, max_skip_fraction: float = 0.5,
                    always_execute: Collection[int] = (), coupled: bool = False,
                    useful_from: int = 1) -> list[tuple[int, int]]:
    """(item, states) for each item a DP with these settings runs forward: the states it
    runs the item on, at most (none pruned by its value). What prices a DP before one has
    run (schedule.py ``SpareRule.dp_seconds``)."""
    counter = _Counting()
    solve(weights, counter, tau=-math.inf, max_skip_fraction=max_skip_fraction,
          always_execute=always_execute, coupled=coupled, useful_from=useful_from)
    return counter.executed


def skip_cap(weights: Sequence[int], max_skip_fraction: float) -> int:
    """The most weight a candidate may skip."""
    return math.floor(max_skip_fraction * sum(weights))


def _skippable_ahead(weights: list[int], forced: set[int]) -> list[int]:
    """``ahead[i]``: the weight of the skippable items from item i on (``ahead[len] = 0``)."""
    ahead = [0] * (len(weights) + 1)
    for i in range(len(weights) - 1, -1, -1):
        ahead[i] = ahead[i + 1] + (0 if i in forced else weights[i])
    return ahead


def _reach(state: int, item: int, weights: list[int], ahead: list[int]) -> int:
    """The most weight a state after ``item`` can have skipped at the end. A coupled
    attention-skipped id -(j + 1) is budget j with its layer's MLP skipped too."""
    if state >= 0:
        return state + ahead[item + 1]
    return -state - 1 + weights[item] + ahead[item + 1]


def _check(weights: list[int], max_skip_fraction: float, always_execute: Collection[int],
           coupled: bool) -> None:
    """Reject inputs the DP cannot represent (a zero weight would make skip and execute collide)."""
    if any(w < 1 for w in weights):
        raise ValueError(f"weights must be integers >= 1, got {weights}")
    if not 0.0 <= max_skip_fraction <= 1.0:
        raise ValueError(f"max_skip_fraction must be in [0, 1], got {max_skip_fraction}")
    if coupled and len(weights) % 2:
        raise ValueError("coupled mode needs an even number of items (attention, mlp per layer)")
    bad = [i for i in always_execute if not 0 <= i < len(weights)]
    if bad:
        raise ValueError(f"always_execute items out of range: {bad}")


def _moves(
    item: int, weights: list[int], values: dict[int, float], *, cap: int, skippable: bool,
    coupled: bool
) -> list[_Move]:
    """All transitions out of the previous stage's states into stage `item`."""
    w = weights[item]
    if not coupled:
        moves = [_Move(j, j, True) for j in sorted(values)]
        if skippable:
            moves += [_Move(j, j + w, False) for j in sorted(values) if j + w <= cap]
        return moves
    if item % 2 == 0:  # attention: execute, or pass through pending a whole-layer skip
        layer_w = w + weights[item + 1]
        moves = [_Move(j, j, True) for j in sorted(values)]
        if skippable:
            moves += [_Move(j, -(j + 1), False) for j in sorted(values) if j + layer_w <= cap]
        return moves
    # mlp: executed ids continue executing, attention-skipped ids (< 0) skip the mlp too
    layer_w = weights[item - 1] + w
    moves = [_Move(s, s, True) for s in sorted(values) if s >= 0]
    moves += [_Move(s, -s - 1 + layer_w, False) for s in sorted(values, reverse=True) if s < 0]
    return moves


def _score(item: int, moves: list[_Move],
           evaluator: StageEvaluator) -> dict[tuple[int, bool], float]:
    """One evaluate call per (item, execute) with every source batched."""
    scored: dict[tuple[int, bool], float] = {}
    for execute in (True, False):
        sources = [m.source for m in moves if m.execute is execute]
        if not sources:
            continue
        out = list(evaluator.evaluate(item, sources, execute))
        if len(out) != len(sources):
            raise ValueError(f"evaluate(item={item}) returned {len(out)} values for "
                             f"{len(sources)} sources")
        for s, v in zip(sources, out):
            v = float(v)
            scored[(s, execute)] = -math.inf if math.isnan(v) else v
    return scored


def _select(
    moves: list[_Move], scored: dict[tuple[int, bool], float], tau: float
) -> tuple[dict[int, tuple[int, bool]], dict[int, float]]:
    """Keep the best move into each target id (ties: execute), then prune below tau."""
    best: dict[int, _Move] = {}
    for m in moves:  # executes come first, so a strict > makes ties prefer execute
        cur = best.get(m.target)
        if cur is None or scored[(m.source, m.execute)] > scored[(cur.source, cur.execute)]:
            best[m.target] = m
    chosen: dict[int, tuple[int, bool]] = {}
    values: dict[int, float] = {}
    for target in sorted(best):
        m = best[target]
        v = scored[(m.source, m.execute)]
        if v < tau and target != 0:
            continue
        chosen[target] = (m.source, m.execute)
        values[target] = v
    return chosen, values


def _backtrack(history: list[dict[int, tuple[int, bool]]], final: int) -> frozenset[int]:
    """Walk the recorded choices from the last stage back to the input, collecting skipped items."""
    skipped = []
    state = final
    for item in range(len(history) - 1, -1, -1):
        state, executed = history[item][state]
        if not executed:
            skipped.append(item)
    if state != 0:
        raise AssertionError(f"backtrack of budget {final} ended at state {state}, not the input")
    return frozenset(skipped)
