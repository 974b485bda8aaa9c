"""Tokens-per-Time search: pick the draft subnet and draft length that decode fastest.

TPT(S, g) = expected_tokens(alpha_S, g) / (g * t_draft(S) + verify_time(g + 1)): the expected
tokens one speculation round yields over its expected cost. Plain autoregressive decoding
(gamma = 0) yields one token per full forward, TPT = 1 / verify_time(1), so it competes on
the same scale and wins when no draft is fast and accurate enough.

Tie-breaking (deterministic): equal TPT goes to the smaller gamma (autoregressive counts as
gamma 0), then to the lower candidate index. The knapsack returns candidates sorted by
skipped weight, so a lower index is the more conservative (more accurate) draft.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

OBJECTIVES = ("tpt", "alpha")


@dataclass(frozen=True)
class Choice:
    """The selected decoding configuration and its predicted throughput."""

    candidate: int | None  # index into the candidate list; None means plain autoregressive decoding
    gamma: int  # draft length; 0 means autoregressive
    tokens_per_time: float  # expected tokens per second under the latency model


def expected_tokens(alpha: float, gamma: int, exit_rate: float = 0.0) -> float:
    """Tokens per round with i.i.d. acceptance a and up to g drafts, each draft position
    ended by the confidence exit with probability e (``exit_rate``; the unsure draft is still
    judged): 1 + a + a^2 c + ... + a^g c^(g-1), c = 1 - e. At e = 0, (1 - a^(g+1)) / (1 - a).

    Evaluated by Horner, which is exact at a = 0 (1) and a = 1, e = 0 (g + 1) and stable near
    1, where the closed form cancels catastrophically.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if not gamma:
        return 1.0
    inner = 1.0
    for _ in range(gamma - 1):
        inner = 1.0 + alpha * (1.0 - exit_rate) * inner
    return 1.0 + alpha * inner


def expected_drafts(gamma: int, exit_rate: float = 0.0) -> float:
    """Draft positions a round judges (and, exiting on the host, drafts) under the exit:
    1 + c + ... + c^(g-1)."""
    return sum((1.0 - exit_rate) ** i for i in range(gamma))


def tokens_per_time(alpha: float, gamma: int, draft_time: float,
                    verify_time: Callable[[int], float], exit_rate: float = 0.0) -> float:
    """TPT of drafting up to `gamma` tokens at `draft_time` each, then one verify over the
    drafts and the pending token."""
    if gamma == 0:
        return 1.0 / verify_time(1)
    drafts = expected_drafts(gamma, exit_rate)
    return (expected_tokens(alpha, gamma, exit_rate)
            / (drafts * draft_time + verify_time(drafts + 1)))


def search(
    alphas: Sequence[float],
    draft_times: Sequence[float],
    verify_time: Callable[[int], float],
    max_gamma: int = 10,
    allow_ar: bool = True,
    objective: str = "tpt",
    min_gain: float = 1.0,
    exit_rate: float = 0.0,
    lower: Sequence[float] | None = None,
) -> Choice:
    """Grid search over (candidate, gamma in 1..max_gamma), plus autoregressive when allowed.

    objective="tpt" maximizes TPT over everything. objective="alpha" (the ablation "maximize
    acceptance instead of TPT") takes the candidate with the highest alpha (ties: lower draft
    time, then lower index) and the gamma that maximizes its TPT; autoregressive is then only
    the fallback when there are no candidates.

    With objective="tpt", ``min_gain`` > 1 keeps plain decoding unless the best speculative
    choice beats it by that factor (a margin for alphas estimated from a handful of tokens);
    ``lower`` (an acceptance each candidate has at least, e.g. its estimate less its noise)
    keeps plain decoding unless the best choice still beats it at that acceptance.
    ``exit_rate``: the confidence exit's chance per draft position (``expected_tokens``).
    """
    if len(alphas) != len(draft_times):
        raise ValueError(f"{len(alphas)} alphas but {len(draft_times)} draft times")
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if not alphas and not allow_ar:
        raise ValueError("no candidates and autoregressive decoding not allowed")

    pool = range(len(alphas))
    if objective == "alpha" and alphas:
        pool = [min(pool, key=lambda k: (-alphas[k], draft_times[k], k))]
    options = [
        Choice(k, g, tokens_per_time(alphas[k], g, draft_times[k], verify_time, exit_rate))
        for k in pool
        for g in range(1, max_gamma + 1)
    ]
    plain = tokens_per_time(1.0, 0, 0.0, verify_time)
    if allow_ar and (objective == "tpt" or not alphas):
        options.append(Choice(None, 0, plain))
    best = max(options, key=_rank)
    if (allow_ar and objective == "tpt" and best.candidate is not None
            and (best.tokens_per_time < min_gain * plain
                 or (lower is not None and tokens_per_time(
                     lower[best.candidate], best.gamma, draft_times[best.candidate],
                     verify_time, exit_rate) < min_gain * plain))):
        best = Choice(None, 0, plain)
    logger.debug("tpt search (%s): %s", objective, best)
    return best


def _rank(c: Choice) -> tuple[float, int, int]:
    """Higher TPT first, then smaller gamma, then lower candidate index (autoregressive = -1)."""
    return (c.tokens_per_time, -c.gamma, -(-1 if c.candidate is None else c.candidate))
