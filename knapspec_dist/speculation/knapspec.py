"""KnapSpec selection: the knapsack DP over hidden states, then the Tokens-per-Time search.

Every DP selector keeps the full model's hidden states (input of every sublayer and output of
every sublayer) at the last ``m`` committed positions, captured for free during verification
(``KnapsackSelector``: what they share, which never calls back into a subclass). Each one's
``decide`` is its whole decision, read top to bottom; KnapSpec's (``KnapSpecSelector``):

0. prices: are they another machine's, not yet checked by this run's clock (``unchecked``)?
   Then plain decoding, and no DP, until they are.
1. cadence: is a selection due (schedule.py ``SelectionSchedule``)?
2. spare: can the due DP be spared, because it cannot pay for itself (``SpareRule``)?
3. DP: weigh each sublayer (its measured latency at the batch's mean context n, integer
   weights, attention growing with n, MLP constant, all-reduce included under TP) and run the
   pure knapsack solver (dp.py, knapsack.py); every stage evaluates all surviving budgets in one
   batched forward of that sublayer over the reference positions, attending to the real KV
   cache prefix, and scores them by mean cosine to the full model's state (hidden_states.py);
   states that cannot reach the least skipped weight that could pay are dropped
   (``SpareRule.least_paying_weight``), which leaves the choice unchanged;
4. estimate: each candidate's acceptance, the posterior of its top-1 agreements with the full
   model and this run's drafts (acceptance.py ``fit_acceptance``);
5. choose: subnet and draft length by Tokens-per-Time (tpt.py; gamma = 0 is plain decoding
   until the next selection);
6. guard: between selections, drop a plan that loses to plain decoding (guard.py).

CLaSp (clasp.py) and the authors' selection (paper.py) write their own ``decide`` from the
same steps. Under TP every rank decides and rank 0's ``Decision`` is adopted by all (spmd.py).
Pricing has one owner: the selector, priced by its ``BatchPricing``, where the hidden states
are (inside each TP rank, SPMD); nothing here is per token.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from knapspec_dist.engine.sequence import Batch
from knapspec_dist.model.decoder import Capture, Transformer
from knapspec_dist.profiles.batching import BatchPricing
from knapspec_dist.profiles.profile import LatencyProfile, integer_weights
from knapspec_dist.profiles.store import keep_online
from knapspec_dist.speculation import knapsack, tpt
from knapspec_dist.speculation.acceptance import AcceptanceBook, fit_acceptance, smoothed_alpha
from knapspec_dist.speculation.calibration import Calibration, RoundTiming
from knapspec_dist.speculation.dp import mean_context, plan_of, reference_positions, run_dp
from knapspec_dist.speculation.guard import PlanGuard, PlanRun
from knapspec_dist.speculation.hidden_states import Reference
from knapspec_dist.speculation.schedule import (
    Frontier,
    Prices,
    ScheduleClock,
    SelectionSchedule,
    SpareRule,
)
from knapspec_dist.speculation.selfspec import Plan, Selector

log = logging.getLogger(__name__)

PLAIN = Plan(frozenset(), 0)


@dataclass(frozen=True)
class KnapSpecConfig:
    """The paper's defaults: D=10, tau=0.5, m=5, re-selection every 64 steps, weight cap 5."""

    max_gamma: int = 10  # D
    tau: float = 0.5  # prune DP states whose mean cosine is below this
    m: int = 5  # reference positions (a row's last m tokens; in a batch, spread over rows)
    reference_rows: int = 2  # rows of a batch whose positions the DP judges drafts on
    interval: int = 64  # generated tokens between selections (at least)
    overhead_budget: float = 0.025  # stretch the interval so selection stays under this share
    min_gain: float = 1.05  # a due DP runs only where a subnet could beat plain decoding by this
    noise_z: float = 1.0  # speculate only where the acceptance estimate less this many of its
    # standard deviations still beats plain decoding (the margin: the estimate's own noise)
    weight_cap: float = 5.0
    max_skip_fraction: float = 0.5
    keep_first_last: bool = True  # always execute the first and the last layer
    coupled: bool = False  # ablation: skip a layer's attention and MLP together
    objective: str = "tpt"  # "tpt" | "alpha" (ablation)
    select_once: bool = False  # ablation: select after prefill only
    calibrate: bool = False  # refit the prices from the run's timed rounds (calibration.py;
    # the strategy ``knapspec`` turns it on: speculation/factory.py)
    subnets: bool = True  # select subnets at all (off: ``knapspec:copy``, copied drafts only)


@dataclass
class Selection:
    """What one selection saw and chose (kept for stats and tests)."""

    context: int
    weights: list[int]
    candidates: list[knapsack.Candidate]
    alphas: list[float]
    choice: tpt.Choice
    plan: Plan
    positions: int = 0  # reference positions the DP and the alphas judged on


@dataclass(frozen=True)
class Decision:
    """What a round's planning decided: the plan, and the schedule's wall-clock state after it
    (None: a selector with no such schedule). Under TP rank 0's is adopted by every rank."""

    plan: Plan
    clock: ScheduleClock | None = None


def choose_by_tpt(profile: LatencyProfile, candidates: list[knapsack.Candidate],
                  alphas: list[float], lower: list[float] | None, n: int, num_layers: int,
                  config: KnapSpecConfig, exit_rate: float) -> tpt.Choice:
    """The TPT search (tpt.py) over ``candidates`` at context n, priced by ``profile``; plain
    decoding unless the best beats it at its ``lower`` acceptance too (the margin)."""
    draft_times = [profile.draft_time(c.skipped, n, num_layers) for c in candidates]
    return tpt.search(alphas, draft_times, lambda q: profile.verify_time(q, n),
                      max_gamma=config.max_gamma, objective=config.objective,
                      exit_rate=exit_rate, lower=lower)


class KnapsackSelector(Selector):
    """What every DP selector keeps: the prices, the hidden states of its rows' last rounds,
    the plan in force and the selections made. Its subclasses' ``decide`` is the decision;
    nothing here calls back into them."""

    def __init__(self, profiles: LatencyProfile | Sequence[LatencyProfile],
                 config: KnapSpecConfig, kept_rounds: int | None = None):
        """``profiles``: one latency profile, or several measured at different batch sizes
        (each round is priced at its batch size, profiles/batching.py); ``kept_rounds``: the
        rounds a row's store keeps (None: every round until cleared)."""
        self.pricing, self.config = BatchPricing(profiles), config
        self.profile = self.pricing.base  # the profile of the current batch size
        self.schedule = SelectionSchedule(config.interval, config.overhead_budget, config.m,
                                          config.select_once)
        self.kept_rounds = kept_rounds
        self.history: list[Selection] = []
        self.selections = 0
        self.calibration: Calibration | None = None  # made at the first start (its layers)
        self.predicted_tps: float | None = None  # what the last selection predicted

    # ------------------------------------------------------------------ prices

    def price(self, batch: int) -> LatencyProfile:
        """The profile that prices a round of ``batch`` rows: the stored one, refitted from
        the run's timed rounds where calibration is on and found a drift."""
        if self.calibration is None:
            return self.pricing.at(batch)
        return self.calibration.profile(batch)

    def timed(self, timing: RoundTiming, report: bool = True) -> None:
        """``report``: whether a refit this round is news to log and save (TP: rank 0's)."""
        if self.calibration is not None:
            self.calibration.observe(timing, report)

    def predicted_rate(self, plan: Plan, context: int) -> float | None:
        if not plan.gamma:
            return 1.0 / self.profile.verify_time(1, context)
        return self.predicted_tps

    @property
    def unchecked(self) -> bool:
        """Whether the prices are another machine's (a borrowed profile) that this run's
        timed rounds have not yet confirmed or refitted (calibration.py ``checked``): no DP
        is run and nothing is drafted on them. A borrowed AMD EPYC profile priced an
        AVX2-only EPYC 2.7x off, and its first DP cost more than plain decoding saved."""
        return (self.pricing.base.origin == "borrowed" and self.calibration is not None
                and not self.calibration.checked)

    def round_prices(self, batch: int) -> LatencyProfile | None:
        return None if self.unchecked else self.price(batch)

    # ------------------------------------------------------------------ Selector

    def start(self, model: Transformer) -> None:
        if self.config.calibrate and self.calibration is None:  # kept across runs
            self.calibration = Calibration(self.pricing.at, model.cfg.num_layers, keep_online)
        # per row, per round observed: its committed positions' [2L+1, d] states
        self.states: dict[int, deque[list[torch.Tensor]]] = {}
        self.plan_now = PLAIN
        self.schedule.start()
        self.history = []

    def wants_reference(self) -> bool:
        """Hidden states are kept only in the rounds that feed the next selection (its last
        m rounds per row), not in every round."""
        return self.schedule.wanting

    def observe(self, hidden: Capture, valid: list[int], rids: list[int]) -> None:
        for b, rid in enumerate(rids):
            stacked = torch.stack([h[b, :valid[b]] for h in hidden], dim=1)  # [valid, 2L+1, d]
            self.states.setdefault(rid, deque(maxlen=self.kept_rounds)).append(
                list(stacked.unbind(0)))

    def record(self, drafts: int, verified: list[int], accepted: list[int]) -> None:
        """The rounds' yield sets how early the window of the next selection opens."""
        self.schedule.observe_round(statistics.fmean(accepted) + 1 if accepted else 1.0)

    def retire(self, rid: int) -> None:
        self.states.pop(rid, None)

    def plan(self, model: Transformer, batch: Batch) -> Plan:
        return self.decide(model, batch).plan

    @abstractmethod
    def decide(self, model: Transformer, batch: Batch) -> Decision:
        """The plan of the next round of ``batch``, and what the schedule made of it."""

    def decision(self) -> Decision:
        """The plan in force and the schedule's wall-clock state."""
        return Decision(self.plan_now, self.schedule.clock())

    def adopt(self, decision: Decision) -> None:
        """Decide as ``decision`` says (TP: rank 0's, on every rank)."""
        self.plan_now = decision.plan
        if decision.clock is not None:
            self.schedule.adopt(decision.clock)

    # ------------------------------------------------------------------ steps they share

    def due(self, batch: Batch) -> bool:
        """Cadence: whether a selection is due now and a row has the m rounds it judges on.
        A new window of rounds that feed it drops the states kept before (only consecutive
        positions up to each row's end count)."""
        if self.schedule.tick(batch.progress):
            self.states.clear()
        m = self.config.m
        return (self.schedule.due(batch.progress)
                and any(len(self.states.get(row.rid, ())) == m for row in batch.rows))

    def clocked(self, select: Callable[[Transformer, Batch, list[Reference]], Selection],
                model: Transformer, batch: Batch) -> Plan:
        """The plan ``select(model, batch, references)`` makes of this round's references;
        its seconds set when the next selection is due."""
        references = self.references(batch)
        start = time.perf_counter()
        plan = select(model, batch, references).plan
        self.schedule.selected(batch.progress, time.perf_counter() - start,
                               self.profile.verify_time(1, mean_context(batch)))
        return plan

    def made(self, selection: Selection) -> Selection:
        """Keep a selection made (stats, tests, the rate it predicted)."""
        self.predicted_tps = selection.choice.tokens_per_time
        self.history.append(selection)
        self.selections += 1
        log.debug("selection at n=%d: %d candidates, chose %s gamma=%d (tpt %.1f tok/s)",
                  selection.context, len(selection.candidates), sorted(selection.plan.skip),
                  selection.plan.gamma, selection.choice.tokens_per_time)
        return selection

    def _ready_rows(self, batch: Batch) -> list[tuple[int, int, list[torch.Tensor]]]:
        """(cache length, slot, positions of its last m rounds) of up to ``reference_rows``
        rows with m rounds observed, longest context first."""
        m, found = self.config.m, []
        for slot, row in enumerate(batch.rows):
            rounds = self.states.get(row.rid)
            if rounds is not None and len(rounds) == m:
                found.append((batch.cache.lengths[slot], slot, [p for r in rounds for p in r]))
        return sorted(found, key=lambda f: -f[0])[:self.config.reference_rows]

    def reference_positions(self, batch: Batch) -> int:
        """r: the positions a DP would judge on now (m before any row has m rounds)."""
        found = self._ready_rows(batch)
        return len(found[0][2]) if found else self.config.m

    def references(self, batch: Batch) -> list[Reference]:
        """The positions of the last m rounds of the longest row with m rounds observed (r of
        them: m when it decoded plainly, up to m (gamma + 1) when it drafted), spread over up
        to ``reference_rows`` rows, longest context first (attention there is what the
        knapsack prices highest), r in all (the DP's cost grows with its positions: 3 + 2
        over two rows costs what one row's 5 does)."""
        found = self._ready_rows(batch)
        if not found:
            return []
        r, out = len(found[0][2]), []
        for i, (end, slot, states) in enumerate(found):
            k = min(len(states), r // len(found) + (i < r % len(found)))
            out.append(Reference(slot, end - k, torch.stack(states[-k:], dim=1)))
        return out


class KnapSpecSelector(KnapsackSelector):
    """KnapSpec: sublayers weighed by their measured latency, the subnet and draft length
    chosen by Tokens-per-Time, a due DP spared where it cannot pay, the plan guarded."""

    def __init__(self, profiles: LatencyProfile | Sequence[LatencyProfile],
                 config: KnapSpecConfig = KnapSpecConfig()):
        super().__init__(profiles, config, kept_rounds=config.m)
        self.guard = PlanGuard()
        self.book = AcceptanceBook()
        self.spare_rule = SpareRule(self.schedule, min_gain=config.min_gain,
                                    max_gamma=config.max_gamma,
                                    max_skip_fraction=config.max_skip_fraction,
                                    keep_first_last=config.keep_first_last,
                                    coupled=config.coupled)
        # whether copied drafts won each recent round, kept across runs as their book is
        self.copies_won: deque[bool] = deque(maxlen=config.interval)

    def decide(self, model: Transformer, batch: Batch) -> Decision:
        """Unchecked prices, cadence, spare, DP (estimate, choose: ``select``), guard."""
        self.profile = self.price(batch.size)
        layers = model.cfg.num_layers
        if self.unchecked or not self.config.subnets:
            self.plan_now = PLAIN  # a due selection waits until the clock has checked them
        elif self.due(batch):
            if self.nothing_pays(batch, mean_context(batch), layers,
                                 self.reference_positions(batch)):
                self.plan_now = PLAIN  # plain decoding until the next selection
                self.guard.watch(None)
                self.schedule.skip(batch.progress)
            else:
                self.plan_now = self.clocked(self.select, model, batch)
        elif self.guard.drops(self.plan_now, self.profile):
            self.plan_now = PLAIN
        return self.decision()

    def select(self, model: Transformer, batch: Batch, references: list[Reference]
               ) -> Selection:
        """DP, estimate, choose; then keep what the spare rule and the guard need."""
        cfg, n, layers = self.config, mean_context(batch), model.cfg.num_layers
        weights = self.weights(n, layers)
        positions = reference_positions(references)
        useful = self.useful_from(weights, n, layers, positions)
        dp = run_dp(model, batch, references, weights, cfg, useful)
        # the DP's own estimates (its agreements under the prior), and with this run's drafts
        dp_alphas = [smoothed_alpha(a, dp.positions) for a in dp.agree]
        alphas, lower = fit_acceptance(self.book, dp.candidates, dp.agree, dp.positions,
                                       cfg.noise_z)
        choice = choose_by_tpt(self.profile, dp.candidates, alphas, lower, n, layers, cfg,
                               self.book.exit_rate)
        selection = Selection(n, weights, dp.candidates, alphas, choice,
                              plan_of(dp.candidates, choice), dp.positions)
        self.remember(selection, dp_alphas, lower, useful)
        return self.made(selection)

    @property
    def by_tokens_per_time(self) -> bool:
        """Whether rounds are priced against plain decoding (not under the alpha ablation)."""
        return self.config.objective == "tpt"

    @property
    def fallbacks(self) -> int:
        return self.guard.fallbacks

    def prices(self, num_layers: int) -> Prices:
        won = self.copies_won
        return Prices(self.profile, num_layers, self.guard.realized_ratio,
                      1.0 - sum(won) / len(won) if won else 1.0)

    def copied(self, won: bool) -> None:
        self.copies_won.append(won)

    def weights(self, n: int, num_layers: int) -> list[int]:
        """The knapsack weight of every sublayer at context n: its measured latency, in
        integer units."""
        return integer_weights(self.profile, n, num_layers, self.config.weight_cap)

    def nothing_pays(self, batch: Batch, n: int, num_layers: int, positions: int) -> bool:
        """Spare: whether a due DP cannot pay for itself (never under the alpha objective,
        which does not price rounds)."""
        if not self.by_tokens_per_time:
            return False
        return self.spare_rule.nothing_pays(self.prices(num_layers), batch,
                                            self.weights(n, num_layers), n, positions)

    def useful_from(self, weights: list[int], n: int, num_layers: int, positions: int) -> int:
        """The least weight that could pay here or at a context up to RESELECT_GROWTH times
        longer (attention dearer, skipping it worth more): the subnets left out could then
        not pay anywhere this DP's frontier is reused (``SpareRule.frontier_rules_out``)."""
        if not self.by_tokens_per_time:
            return 1
        prices = self.prices(num_layers)
        return min(self.spare_rule.least_paying_weight(prices, weights, c, positions)
                   for c in (n, math.ceil(n * SpareRule.RESELECT_GROWTH)))

    def remember(self, selection: Selection, dp_alphas: list[float],
                 lower: list[float] | None, useful: int) -> None:
        """Keep a fruitless DP's frontier (``dp_alphas``: the DP's own estimates; ``lower``:
        the margin the choice weighed) for the spare rule; guard a speculative plan."""
        choice, n = selection.choice, selection.context
        plain = choice.candidate is None or not choice.gamma
        self.spare_rule.frontier = Frontier(
            n, selection.weights, useful, [c.skipped for c in selection.candidates],
            dp_alphas, lower, self.spare_rule.fruitless(n)) if plain else None
        num_layers = len(selection.weights) // 2
        self.guard.watch(None if plain else PlanRun(
            n, dp_alphas[choice.candidate],
            self.profile.draft_time(selection.plan.skip, n, num_layers)))

    def start(self, model: Transformer) -> None:
        super().start(model)
        self.guard.start()
        self.book.start()

    def record(self, drafts: int, verified: list[int], accepted: list[int]) -> None:
        super().record(drafts, verified, accepted)
        self.guard.record(drafts, verified, accepted, self.profile)
        if drafts and self.plan_now.gamma:
            self.book.record(self.plan_now.skip, self.plan_now.gamma, verified, accepted)
