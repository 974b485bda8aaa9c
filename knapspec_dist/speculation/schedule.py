"""When a selector re-runs its knapsack DP, and when a due DP is spared.

Cadence (``SelectionSchedule``): the paper's reference is the hidden states of the tokens
generated in the last m steps, so the first selection waits for m of them (m plain decode
steps, which cost nothing over ``ar``) instead of judging drafts on the prompt's last
positions (with a chat template those are the assistant header, a poor sample of what gets
drafted). Then a selection is due every ``interval`` generated tokens, stretched while one
selection costs more than ``overhead_budget`` of the decoding it steers (a CPU runs the
batched DP slowly; a GPU does not). Hidden states are kept only in the rounds that feed the
next selection.

Sparing (``SpareRule``): a due selection is spared, and decoding stays plain, where the DP
cannot pay for itself: no weight could pay at these prices, the batch has too few tokens left
to repay a DP's cost (the last one's, or before any has run its price: ``dp_seconds``) in the
rounds a subnet would draft in (not those that copied drafts win), or the last fruitless DP's
subnets, priced again at today's batch size and context, still lose. Everything it prices
comes from the profile (counts, not the wall clock), except the cost of the last DP and the
time of the next (``ScheduleClock``), which under TP every rank takes from rank 0
(speculation/spmd.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from knapspec_dist.engine.sequence import Batch
from knapspec_dist.profiles.profile import LatencyProfile
from knapspec_dist.speculation import knapsack, tpt
from knapspec_dist.speculation.acceptance import smoothed_alpha


@dataclass(frozen=True)
class ScheduleClock:
    """What a schedule set from the wall clock: the progress at which the next selection is
    due (from the last DP's seconds) and those seconds (None: no DP yet). A rank's own clock
    differs from another's; under TP all take rank 0's."""

    next_selection: float
    last_select_s: float | None


class SelectionSchedule:
    """The cadence of selections, in tokens per row of the batch (``Batch.progress``)."""

    def __init__(self, interval: int, overhead_budget: float, m: int, once: bool = False):
        """``m``: reference positions a selection judges on (the first waits for them);
        ``once``: select after the first m tokens only (an ablation)."""
        self.every, self.overhead_budget, self.m, self.once = interval, overhead_budget, m, once
        # Kept across runs: what the last DP cost and the decoding rounds since (SpareRule).
        self.last_select_s: float | None = None
        self.rounds_since_dp = 0
        self.spared = 0  # due selections not run: no subnet could beat plain decoding
        self.tokens_per_round = 1.0  # recent tokens per row per round (kept across runs)
        self.start()

    TOKENS_EMA = 0.25  # the weight of the last round in ``tokens_per_round``

    def observe_round(self, tokens: float) -> None:
        """A round committed ``tokens`` per row."""
        self.tokens_per_round += self.TOKENS_EMA * (tokens - self.tokens_per_round)

    def start(self) -> None:
        """A batch run begins: the first selection after m generated tokens per row."""
        self.next_selection = self.m
        self.wanting = True  # whether the rounds now keep hidden states
        self.selected_in_run = False

    def clock(self) -> ScheduleClock:
        return ScheduleClock(self.next_selection, self.last_select_s)

    def adopt(self, clock: ScheduleClock) -> None:
        """Take ``clock``'s wall-clock state (TP: rank 0's) for this schedule's own."""
        self.next_selection, self.last_select_s = clock.next_selection, clock.last_select_s

    @property
    def closed(self) -> bool:
        return self.once and self.selected_in_run

    def tick(self, progress: float) -> bool:
        """A round begins at ``progress``. Whether the window of the rounds that feed the
        next selection (its last m rounds per row) opens now: the states kept before are
        then stale (only consecutive positions up to each row's end count)."""
        self.rounds_since_dp += 1
        ahead = (self.m + 1) * self.tokens_per_round  # m rounds' tokens, and the next one
        wants = not self.closed and progress + ahead >= self.next_selection
        opened = wants and not self.wanting
        self.wanting = wants
        return opened

    def due(self, progress: float) -> bool:
        return not self.closed and progress >= self.next_selection

    def interval(self, select_s: float, step_s: float) -> int:
        """Tokens until the next selection: ``interval``, stretched when one selection
        (``select_s``) costs more than ``overhead_budget`` of the decoding it steers, at
        ``step_s`` (the profile's time of one plain decode step) per token."""
        needed = select_s / (self.overhead_budget * step_s) if step_s > 0 else 0
        return max(self.every, math.ceil(needed))

    def selected(self, progress: float, select_s: float, step_s: float) -> None:
        """A DP ran at ``progress`` and took ``select_s`` seconds."""
        self.last_select_s = select_s
        self.rounds_since_dp = 0
        self.selected_in_run = True
        self.next_selection = progress + self.interval(select_s, step_s)

    def skip(self, progress: float) -> None:
        """A due DP spared at ``progress``: the next one an interval on."""
        self.spared += 1
        self.next_selection = progress + self.every


@dataclass(frozen=True)
class Prices:
    """What decoding costs now: the profile at the batch's size, for a model of
    ``num_layers`` layers, and the realized/predicted acceptance ratio the DP's alphas are
    scaled by (guard.py ``PlanGuard.realized_ratio``)."""

    profile: LatencyProfile
    num_layers: int
    acceptance_ratio: float = 1.0
    subnet_share: float = 1.0  # the share of recent rounds no copied draft won (a subnet's)

    def step(self, n: int) -> float:
        """One plain decode step at context n."""
        return self.profile.verify_time(1, n)


@dataclass(frozen=True)
class Frontier:
    """What a DP that chose plain decoding returned: its subnets and the acceptance the DP
    alone estimated for each (``smoothed_alpha`` of its agreements), at context ``context``,
    weights ``weights``, subnets skipping less than ``useful_from`` not evaluated; ``lower``:
    the acceptance each had at least (its estimate less its noise), as the DP's choice weighed
    it. Priced again at a later batch size or context, it can
    spare the next DP."""

    context: int
    weights: list[int]
    useful_from: int
    skips: list[frozenset[int]]
    alphas: list[float]
    lower: list[float] | None = None
    fruitless: int = 1  # the DPs in a row at about this context that chose plain decoding


class SpareRule:
    """Whether a due DP can pay for itself, from the prices of the moment and what the last
    DP found and cost (``schedule``)."""

    RESELECT_GROWTH = 1.25  # context growth that makes a fruitless selection worth redoing
    RECHECK_SHARE = 0.01  # ... and the share of decoding time a periodic re-check may cost
    REPRICED_UNTIL = 2  # fruitless DPs in a row after which new prices no longer call a DP
    MAX_BACKOFF = 8  # the most the re-check's interval grows by after fruitless DPs in a row

    def __init__(self, schedule: SelectionSchedule, *, min_gain: float, max_gamma: int,
                 max_skip_fraction: float, keep_first_last: bool = False,
                 coupled: bool = False):
        self.schedule = schedule
        self.min_gain, self.max_gamma = min_gain, max_gamma
        self.max_skip_fraction = max_skip_fraction
        self.keep_first_last, self.coupled = keep_first_last, coupled  # the DP's settings
        self.frontier: Frontier | None = None  # kept across runs (frontier_rules_out)

    def nothing_pays(self, prices: Prices, batch: Batch, weights: list[int], n: int,
                     positions: int) -> bool:
        """Whether a due selection can be spared: no subnet could beat plain decoding at
        context n (``least_paying_weight`` past the cap), the most any subnet could save over
        the batch's remaining tokens is less than the last DP cost (``worth_a_dp``), or the
        last DP's frontier says so (``frontier_rules_out``)."""
        cap = knapsack.skip_cap(weights, self.max_skip_fraction)
        return (self.least_paying_weight(prices, weights, n, positions) > cap
                or not self.worth_a_dp(prices, batch, weights, n, positions)
                or self.frontier_rules_out(prices, n, positions))

    def best_rate(self, prices: Prices, weights: list[int], n: int, positions: int
                  ) -> Callable[[int], float]:
        """j -> the most tokens/s a subnet skipping weight j (of ``weights``) could decode at
        at context n: drafting at the highest acceptance the DP can estimate from
        ``positions`` reference positions (all agree, then scaled by the acceptance ratio),
        and saving j times the most time one unit of weight stands for. Increasing in j."""
        p = prices.profile
        alpha = min(1.0, prices.acceptance_ratio * smoothed_alpha(positions, positions))
        times = (p.attention_time(n), p.mlp_time())
        per_weight = max(times[i % 2] / w for i, w in enumerate(weights))
        full = p.draft_time(frozenset(), n, prices.num_layers)

        def rate(j: int) -> float:
            draft = max(p.head, full - j * per_weight)
            return max(tpt.tokens_per_time(alpha, g, draft, lambda q: p.verify_time(q, n))
                       for g in range(1, self.max_gamma + 1))
        return rate

    def least_paying_weight(self, prices: Prices, weights: list[int], n: int,
                            positions: int) -> int:
        """The least skipped weight (of ``weights``) with which a subnet could beat plain
        decoding by ``min_gain`` at context n (``best_rate``); ``sum(weights) + 1`` when no
        weight can. The DP drops states that cannot reach it (knapsack.solve's
        ``useful_from``); where it is past the cap the DP is not run."""
        rate = self.best_rate(prices, weights, n, positions)
        needed = self.min_gain / prices.step(n)
        lo, hi = 1, sum(weights) + 1  # the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if rate(mid) >= needed else (mid + 1, hi)
        return lo

    def worth_a_dp(self, prices: Prices, batch: Batch, weights: list[int], n: int,
                   positions: int) -> bool:
        """Whether the most a DP could save, drafting from the cheapest subnet at the best
        rate (``best_rate``) in the rounds a subnet would draft in (``subnet_share``) until the
        batch's longest remaining row is done, exceeds what a DP costs: the last one's
        seconds, or before any its price (``dp_seconds``). It spares the DPs of a batch's last
        tokens (a job's tail, where rows finish and the batch shrinks), a first DP on a CPU
        where a verify of many tokens is dear, and DPs where copied drafts win the rounds."""
        if not batch.rows:
            return True
        cost = self.schedule.last_select_s
        if cost is None:
            cost = self.dp_seconds(prices, weights, n, positions)
        cap = knapsack.skip_cap(weights, self.max_skip_fraction)
        step = prices.step(n)
        best = self.best_rate(prices, weights, n, positions)(cap)
        remaining = max(r.limit - len(r.out) for r in batch.rows)
        saved = remaining * step * max(0.0, 1.0 - 1.0 / (step * best))
        return prices.subnet_share * saved > cost

    def dp_seconds(self, prices: Prices, weights: list[int], n: int, positions: int) -> float:
        """A DP's price before one has run: each item's forward over its states' ``positions``
        reference positions (knapsack.py ``executed_states``, none pruned by value), then the
        head over the final states' positions (their agreements, dp.py), each priced as the
        profile's sublayer at context n plus, per further token, the share of a step that a
        verify's extra token costs (its measured verifies' slope). At most what it will cost:
        states pruned by their value are priced too."""
        p = prices.profile
        useful = self.least_paying_weight(prices, weights, n, positions)
        work = knapsack.executed_states(weights, max_skip_fraction=self.max_skip_fraction,
                                        always_execute=knapsack.first_and_last_layers(
                                            len(weights)) if self.keep_first_last else (),
                                        coupled=self.coupled, useful_from=useful)
        step, widest = p.verify_time(1, n), max(p.verify)
        per_token = ((p.verify_time(widest, n) - step) / ((widest - 1) * step)
                     if widest > 1 else 1.0)  # a further token, as a share of the first's

        def priced(one: float, tokens: int) -> float:
            return one * (1.0 + max(tokens - 1, 0) * max(per_token, 0.0))

        attention, mlp = p.attention_time(n), p.mlp_time()
        total = sum(priced(attention if item % 2 == 0 else mlp, states * positions)
                    for item, states in work)
        final = work[-1][1] if work else 0
        return total + priced(p.head, final * positions)

    def frontier_at(self, n: int) -> Frontier | None:
        """The last fruitless DP's frontier, where context n has not grown past
        ``RESELECT_GROWTH`` of its context (beyond, it says nothing)."""
        f = self.frontier
        return f if f is not None and n <= self.RESELECT_GROWTH * f.context else None

    def fruitless(self, n: int) -> int:
        """The DPs in a row that chose plain decoding, a plain choice at context n included
        (the count restarts where the context grew past ``RESELECT_GROWTH``)."""
        f = self.frontier_at(n)
        return 1 if f is None else f.fruitless + 1

    def frontier_rules_out(self, prices: Prices, n: int, positions: int) -> bool:
        """The last DP chose plain decoding at a context within ``RESELECT_GROWTH`` of n, and
        at today's prices (batch size, context, acceptance ratio) neither the subnets it returned
        nor the ones it did not (which skipped less than its ``useful_from``) could pay. It is
        redone anyway once the decoding since, priced by the profile, reaches the DP's cost
        over ``RECHECK_SHARE`` (other rows, other text), an interval that doubles with every
        fruitless DP in a row (up to ``MAX_BACKOFF``). Rows of similar length pay for one DP,
        not one each. Hysteresis: once ``REPRICED_UNTIL`` DPs in a row found nothing, new
        prices alone no longer call a DP (calibration's refits move them by the machine's
        noise, and a DP called by such a move finds nothing again); the re-check and a longer
        context still do."""
        f = self.frontier_at(n)
        if f is None:
            return False
        decoded = self.schedule.rounds_since_dp * prices.step(n)  # priced: rank-equal
        backoff = min(2 ** (f.fruitless - 1), self.MAX_BACKOFF)
        if decoded * self.RECHECK_SHARE >= backoff * (self.schedule.last_select_s or 0.0):
            return False  # the rows have changed enough since: check again, at 1 % of time
        if f.fruitless >= self.REPRICED_UNTIL:
            return True
        p = prices.profile
        if f.skips:
            # priced as the DP chose, its noise margin included: without it a subnet the DP
            # turned down for its margin looks paying here, and every due DP is redone
            alphas = [min(1.0, prices.acceptance_ratio * a) for a in f.alphas]
            lower = None if f.lower is None else [min(1.0, prices.acceptance_ratio * a)
                                                  for a in f.lower]
            times = [p.draft_time(skip, n, prices.num_layers) for skip in f.skips]
            choice = tpt.search(alphas, times, lambda q: p.verify_time(q, n),
                                max_gamma=self.max_gamma, min_gain=self.min_gain, lower=lower)
            if choice.candidate is not None:
                return False
        return self.least_paying_weight(prices, f.weights, n, positions) >= f.useful_from
