"""The KnapSpec DP against brute force, with an additive evaluator (where the DP is an exact
knapsack)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from knapspec_dist.speculation.knapsack import Candidate, solve

BASE = 1.0


class AdditiveEvaluator:
    """Value of a state = BASE - sum of the penalties of its skipped items; logs every call."""

    def __init__(self, penalties: list[float]) -> None:
        self.penalties = penalties
        self.states: dict[int, float] = {0: BASE}
        self.pending: dict[tuple[int, bool], float] = {}
        self.calls: list[tuple[int, list[int], bool]] = []
        self.kept: list[dict[int, tuple[int, bool]]] = []

    def evaluate(self, item: int, sources: list[int], execute: bool) -> list[float]:
        assert item == len(self.kept), "evaluate must follow the stages in order"
        assert all(s in self.states for s in sources), (
            "sources must be states of the previous stage")
        self.calls.append((item, list(sources), execute))
        out = [self.states[s] - (0.0 if execute else self.penalties[item]) for s in sources]
        self.pending.update({(s, execute): v for s, v in zip(sources, out)})
        return out

    def keep(self, item: int, chosen: dict[int, tuple[int, bool]]) -> None:
        assert all(key in self.pending for key in chosen.values()), (
            "kept states must have been evaluated")
        self.states = {j: self.pending[key] for j, key in chosen.items()}
        self.pending = {}
        self.kept.append(dict(chosen))


def brute_force(
    weights: list[int],
    value_fn,
    *,
    tau: float = -math.inf,
    max_skip_fraction: float = 0.5,
    always_execute=(),
    coupled: bool = False,
) -> dict[int, float]:
    """Best value for every exact skipped weight j > 0 over all allowed subsets."""
    cap = math.floor(max_skip_fraction * sum(weights))
    n = len(weights)
    if coupled:
        units = [(2 * layer, 2 * layer + 1) for layer in range(n // 2)]
    else:
        units = [(i,) for i in range(n)]
    units = [u for u in units if not set(u) & set(always_execute)]
    best: dict[int, float] = {}
    for r in range(1, len(units) + 1):
        for combo in itertools.combinations(units, r):
            skipped = [i for u in combo for i in u]
            j = sum(weights[i] for i in skipped)
            if j > cap:
                continue
            v = value_fn(skipped)
            if v >= tau and v > best.get(j, -math.inf):
                best[j] = v
    return best


def additive_value(penalties: list[float]):
    return lambda skipped: BASE - sum(penalties[i] for i in skipped)


def check_against_brute_force(
    cands: list[Candidate], expected: dict[int, float], weights, penalties
) -> None:
    assert [c.skipped_weight for c in cands] == sorted(expected)
    for c in cands:
        assert c.value == pytest.approx(expected[c.skipped_weight], abs=1e-12)
        # backtracking returns a subset that really has this weight and this value
        assert sum(weights[i] for i in c.skipped) == c.skipped_weight
        assert additive_value(penalties)(c.skipped) == pytest.approx(c.value, abs=1e-12)


def random_instance(seed: int, n_items: int):
    rng = random.Random(seed)
    weights = [rng.randint(1, 5) for _ in range(n_items)]
    penalties = [rng.uniform(0.0, 0.3) for _ in range(n_items)]
    return rng, weights, penalties


@pytest.mark.parametrize("seed", range(12))
def test_exact_against_brute_force(seed: int) -> None:
    n_items = [2, 6, 10, 16][seed % 4]
    rng, weights, penalties = random_instance(seed, n_items)
    fraction = rng.choice([0.3, 0.5, 1.0])
    always = rng.sample(range(n_items), k=rng.randint(0, 2))
    cands = solve(
        weights,
        AdditiveEvaluator(penalties),
        tau=-math.inf,
        max_skip_fraction=fraction,
        always_execute=always,
    )
    expected = brute_force(
        weights, additive_value(penalties), max_skip_fraction=fraction, always_execute=always
    )
    check_against_brute_force(cands, expected, weights, penalties)
    assert all(not c.skipped & set(always) for c in cands)


@pytest.mark.parametrize("seed", range(10))
def test_coupled_against_brute_force(seed: int) -> None:
    rng, weights, penalties = random_instance(100 + seed, 2 * (1 + seed % 8))
    fraction = rng.choice([0.5, 1.0])
    always = rng.sample(range(len(weights)), k=rng.randint(0, 2))
    cands = solve(
        weights,
        AdditiveEvaluator(penalties),
        tau=-math.inf,
        max_skip_fraction=fraction,
        always_execute=always,
        coupled=True,
    )
    expected = brute_force(
        weights,
        additive_value(penalties),
        max_skip_fraction=fraction,
        always_execute=always,
        coupled=True,
    )
    check_against_brute_force(cands, expected, weights, penalties)
    for c in cands:
        assert all((i ^ 1) in c.skipped for i in c.skipped), (
            "a layer is skipped whole or not at all")


def test_coupled_keeps_both_substates_at_a_colliding_budget() -> None:
    # Layer 0 (w 1+1) is cheap to skip, layer 1 (w 2+2) is not. The state "attention 1 executed
    # at budget 2" and "attention 1 skipped from budget 0" have the same skipped weight after
    # attention 1; only keeping both yields budget 4 (skip layer 1) as well as budget 2.
    weights, penalties = [1, 1, 2, 2], [0.0, 0.0, 0.1, 0.1]
    cands = solve(
        weights, AdditiveEvaluator(penalties), tau=-math.inf, max_skip_fraction=1.0, coupled=True
    )
    assert [(c.skipped_weight, sorted(c.skipped)) for c in cands] == [
        (2, [0, 1]), (4, [2, 3]), (6, [0, 1, 2, 3])
    ]


@pytest.mark.parametrize("seed", range(6))
def test_pruning_matches_brute_force_above_tau(seed: int) -> None:
    _, weights, penalties = random_instance(200 + seed, 12)
    tau = 0.6
    cands = solve(weights, AdditiveEvaluator(penalties), tau=tau, max_skip_fraction=1.0)
    expected = brute_force(weights, additive_value(penalties), tau=tau, max_skip_fraction=1.0)
    check_against_brute_force(cands, expected, weights, penalties)
    assert all(c.value >= tau for c in cands)


def test_pruned_states_are_dropped_but_the_all_executed_path_is_kept() -> None:
    ev = AdditiveEvaluator([0.6, 0.6, 0.6])  # every skip falls below tau=0.5
    assert solve([1, 1, 1], ev, tau=0.5, max_skip_fraction=1.0) == []
    # budget 0 survives while a skip is still ahead of it (after the last item it cannot
    # become a candidate any more)
    assert [set(chosen) for chosen in ev.kept] == [{0}, {0}, set()]
    # even when the full model's own state scores below tau
    low = AdditiveEvaluator([0.0, 0.0, 0.0])
    low.states = {0: 0.1}
    assert solve([1, 1, 1], low, tau=0.5, max_skip_fraction=1.0) == []
    assert [set(c) for c in low.kept] == [{0}, {0}, set()]


def test_one_batched_evaluate_call_per_item_and_mode() -> None:
    weights, penalties = [1, 2, 1, 3, 2, 1], [0.05] * 6
    ev = AdditiveEvaluator(penalties)
    solve(weights, ev, tau=-math.inf, max_skip_fraction=0.5, always_execute=[3])
    keys = [(item, execute) for item, _, execute in ev.calls]
    assert len(keys) == len(set(keys))
    executed = {(i, True) for i in range(6)}
    skipped = {(i, False) for i in range(6) if i != 3}  # item 3 is always executed
    assert sorted(keys) == sorted(executed | skipped)
    for item, sources, execute in ev.calls:  # every live state of the previous stage, in one call
        prev = sorted(ev.kept[item - 1]) if item else [0]
        if execute:
            assert sources == prev
        else:
            cap = math.floor(0.5 * sum(weights))
            assert sources == [j for j in prev if j + weights[item] <= cap]


def test_ties_prefer_execute_and_cap_is_respected() -> None:
    # Skipping either item costs nothing; budget 1 can come from skipping item 0 or item 1.
    # At item 1, "execute from budget 1" ties "skip from budget 0": execute wins.
    cands = solve([1, 1], AdditiveEvaluator([0.0, 0.0]), tau=-math.inf, max_skip_fraction=0.5)
    assert cands == [Candidate(frozenset({0}), 1, BASE)]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("coupled", [False, True])
def test_useful_from_returns_the_full_dps_candidates_at_or_above_it(
    seed: int, coupled: bool
) -> None:
    n_items = [6, 10, 16][seed % 3]
    rng, weights, penalties = random_instance(300 + seed, n_items)
    always = rng.sample(range(n_items), k=rng.randint(0, 2))
    tau = rng.choice([-math.inf, 0.6])
    full_ev = AdditiveEvaluator(penalties)
    full = solve(weights, full_ev, tau=tau, always_execute=always, coupled=coupled)
    cap = math.floor(0.5 * sum(weights))
    for useful_from in (0, 1, cap // 2, cap - 1, cap, cap + 1):
        ev = AdditiveEvaluator(penalties)
        got = solve(weights, ev, tau=tau, always_execute=always, coupled=coupled,
                    useful_from=useful_from)
        assert got == [c for c in full if c.skipped_weight >= useful_from]
        evaluated = sum(len(sources) for _, sources, _ in ev.calls)
        assert evaluated <= sum(len(sources) for _, sources, _ in full_ev.calls)
        if useful_from > cap:
            assert ev.calls == []  # nothing can be useful: nothing is evaluated


def test_useful_from_drops_states_that_cannot_reach_it() -> None:
    # 8 items of weight 1, cap 4; only budget 4 is useful. After item 5 (two skippable items
    # ahead) a state needs budget >= 2, so budgets 0 and 1 are no longer evaluated.
    ev = AdditiveEvaluator([0.01] * 8)
    got = solve([1] * 8, ev, tau=-math.inf, useful_from=4)
    assert [c.skipped_weight for c in got] == [4]
    assert sorted(ev.kept[5]) == [2, 3, 4]
    assert sorted(ev.kept[7]) == [4]
    execute_sources = {item: sources for item, sources, execute in ev.calls if execute}
    assert execute_sources[6] == [2, 3, 4] and execute_sources[7] == [3, 4]


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError):
        solve([1, 0], AdditiveEvaluator([0.0, 0.0]))
    with pytest.raises(ValueError):
        solve([1, 1, 1], AdditiveEvaluator([0.0] * 3), coupled=True)
    with pytest.raises(ValueError):
        solve([1, 1], AdditiveEvaluator([0.0] * 2), always_execute=[5])
