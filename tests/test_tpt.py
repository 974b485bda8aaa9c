"""Tokens-per-Time search against brute force over (candidate, gamma)."""

from __future__ import annotations

import random

import pytest

from knapspec_dist.speculation.tpt import Choice, expected_tokens, search


def brute_force(alphas, draft_times, verify_time, max_gamma, allow_ar) -> float:
    best = 1.0 / verify_time(1) if allow_ar else -1.0
    for a, t in zip(alphas, draft_times):
        for g in range(1, max_gamma + 1):
            e = (1 - a ** (g + 1)) / (1 - a) if a < 1 else g + 1
            best = max(best, e / (g * t + verify_time(g + 1)))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_search_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    k = rng.randint(1, 8)
    alphas = [rng.uniform(0.0, 0.99) for _ in range(k)]
    draft_times = [rng.uniform(0.05, 1.0) for _ in range(k)]
    c0, c1 = rng.uniform(0.5, 1.5), rng.uniform(0.0, 0.3)
    verify = lambda q: c0 + c1 * q  # noqa: E731
    max_gamma, allow_ar = rng.randint(1, 10), rng.random() < 0.7
    choice = search(alphas, draft_times, verify, max_gamma=max_gamma, allow_ar=allow_ar)
    assert choice.tokens_per_time == pytest.approx(
        brute_force(alphas, draft_times, verify, max_gamma, allow_ar))
    if choice.candidate is None:
        assert choice.gamma == 0 and allow_ar
    else:
        assert 1 <= choice.gamma <= max_gamma
        a, t = alphas[choice.candidate], draft_times[choice.candidate]
        g = choice.gamma
        assert choice.tokens_per_time == pytest.approx(
            expected_tokens(a, g) / (g * t + verify(g + 1)))


def test_autoregressive_wins_when_verification_is_expensive_and_alpha_low() -> None:
    choice = search([0.1, 0.2], [0.5, 0.6], lambda q: 1.0 + 0.5 * q)
    assert choice == Choice(None, 0, pytest.approx(1 / 1.5))


def test_good_cheap_draft_beats_autoregressive() -> None:
    choice = search([0.9], [0.1], lambda q: 1.0)
    assert choice.candidate == 0 and choice.gamma > 1
    assert choice.tokens_per_time > 1.0


def test_min_gain_keeps_plain_decoding_on_a_thin_margin() -> None:
    best = search([0.5], [0.2], lambda q: 1.0)  # 1.5 tokens per 1.2 s: 1.25x plain
    assert best.candidate == 0 and best.tokens_per_time == pytest.approx(1.25)
    assert search([0.5], [0.2], lambda q: 1.0, min_gain=1.2) == best
    assert search([0.5], [0.2], lambda q: 1.0, min_gain=1.3) == Choice(None, 0, 1.0)
    # the alpha ablation ignores TPT when choosing, so it ignores the margin too
    assert search([0.5], [0.2], lambda q: 1.0, min_gain=1.3, objective="alpha").candidate == 0


def test_expected_tokens_limits() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(1.0 - 1e-12, 7) == pytest.approx(8.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.7, 0) == 1.0
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)


def test_alpha_one_prefers_the_longest_draft() -> None:
    choice = search([1.0], [0.01], lambda q: 1.0, max_gamma=10)
    assert choice.gamma == 10
    assert choice.tokens_per_time == pytest.approx(11 / (10 * 0.01 + 1.0))


def test_objective_alpha_picks_the_most_accurate_candidate() -> None:
    alphas, times = [0.6, 0.95, 0.95], [0.1, 0.5, 0.4]
    verify = lambda q: 1.0  # noqa: E731
    by_alpha = search(alphas, times, verify, objective="alpha")
    assert by_alpha.candidate == 2  # tie on alpha -> lower draft time
    best_g = max(range(1, 11), key=lambda g: expected_tokens(0.95, g) / (g * 0.4 + 1.0))
    assert by_alpha.gamma == best_g
    by_tpt = search(alphas, times, verify)
    assert by_tpt.tokens_per_time >= by_alpha.tokens_per_time


def test_objective_alpha_never_falls_back_to_ar_while_candidates_exist() -> None:
    assert search([0.1], [0.5], lambda q: 1.0 + q, objective="alpha").candidate == 0
    assert search([], [], lambda q: 1.0, objective="alpha").candidate is None


def test_ties_break_to_smaller_gamma_then_lower_index() -> None:
    # alpha 0 and free drafts: every gamma of every candidate has TPT 1 / verify, like AR
    choice = search([0.0, 0.0], [0.0, 0.0], lambda q: 2.0)
    assert choice == Choice(None, 0, 0.5)
    choice = search([0.0, 0.0], [0.0, 0.0], lambda q: 2.0, allow_ar=False)
    assert choice == Choice(0, 1, 0.5)


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError):
        search([], [], lambda q: 1.0, allow_ar=False)
    with pytest.raises(ValueError):
        search([0.5], [0.1, 0.2], lambda q: 1.0)
    with pytest.raises(ValueError):
        search([0.5], [0.1], lambda q: 1.0, objective="speed")
