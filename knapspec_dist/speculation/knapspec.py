"""KnapSpec selection: the knapsack DP over hidden states, then the Tokens-per-Time search.

A ``KnapsackSelector`` keeps the full model's hidden states (input of every sublayer and output
of every sublayer) at the last ``m`` committed positions, captured for free during
verification. When its schedule says a selection is due (schedule.py), it:

1. weighs each sublayer (KnapSpec: priced from the latency profile at the current context
   length n, integer weights, attention growing with n, MLP constant, all-reduce included
   under TP; CLaSp, clasp.py: every layer alike);
2. runs the pure knapsack solver (knapsack.py); every stage evaluates all surviving budgets
   in one batched forward of that sublayer over the reference positions, attending to the
   real KV cache prefix, and scores them by mean cosine to the full model's state
   (hidden_states.py); KnapSpec drops states that cannot reach the least skipped weight that
   could pay (``SpareRule.least_paying_weight``), which leaves the choice unchanged;
3. estimates each candidate's acceptance from top-1 agreement with the full model;
4. chooses subnet and draft length (KnapSpec: by Tokens-per-Time, tpt.py, where gamma = 0
   means plain autoregressive decoding until the next selection).

KnapSpec also spares a due DP that cannot pay for itself (``SpareRule``) and guards the plan
in force between selections (guard.py). Pricing has one owner: this selector, priced by its
``BatchPricing``, where the hidden states are (inside each TP rank, SPMD); nothing here is per
token.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from knapspec_dist.engine.sequence import Batch
from knapspec_dist.model.decoder import Capture, Transformer
from knapspec_dist.profiles.batching import BatchPricing
from knapspec_dist.profiles.profile import LatencyProfile, integer_weights
from knapspec_dist.profiles.store import keep_online
from knapspec_dist.speculation import knapsack, tpt
from knapspec_dist.speculation.acceptance import AcceptanceBook
from knapspec_dist.speculation.calibration import Calibration, RoundTiming
from knapspec_dist.speculation.guard import PlanGuard, PlanRun
from knapspec_dist.speculation.hidden_states import HiddenStateEvaluator, Reference
from knapspec_dist.speculation.schedule import (
    Frontier,
    Prices,
    SelectionSchedule,
    SpareRule,
    smoothed_alpha,
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


class KnapsackSelector(Selector):
    """Re-selects the draft subnet by the knapsack DP over the full model's hidden states, at
    the times its schedule sets; subclasses weigh the sublayers and choose among the
    candidates (KnapSpec here, CLaSp in clasp.py)."""

    def __init__(self, profiles: LatencyProfile | Sequence[LatencyProfile],
                 config: KnapSpecConfig):
        """``profiles``: one latency profile, or several measured at different batch sizes
        (each round is priced at its batch size, profiles/batching.py)."""
        self.pricing, self.config = BatchPricing(profiles), config
        self.profile = self.pricing.base  # the profile of the current batch size
        self.schedule = SelectionSchedule(config.interval, config.overhead_budget, config.m,
                                          config.select_once)
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

    def timed(self, timing: RoundTiming) -> None:
        if self.calibration is not None:
            self.calibration.observe(timing)

    def predicted_rate(self, plan: Plan, context: int) -> float | None:
        if not plan.gamma:
            return 1.0 / self.profile.verify_time(1, context)
        return self.predicted_tps

    # ------------------------------------------------------------------ what subclasses say

    def weights(self, n: int, num_layers: int) -> list[int]:
        """The knapsack weight of every sublayer at context n: its measured latency, in
        integer units (CLaSp weighs every layer alike)."""
        return integer_weights(self.profile, n, num_layers, self.config.weight_cap)

    @abstractmethod
    def choose(self, candidates: list[knapsack.Candidate], alphas: list[float], n: int,
               num_layers: int) -> tpt.Choice:
        """The candidate and draft length to decode with (candidate None: plain decoding)."""

    def nothing_pays(self, batch: Batch, n: int, num_layers: int, positions: int) -> bool:
        """Whether a due selection can be spared (never, unless the subclass prices it)."""
        return False

    def useful_from(self, weights: list[int], n: int, num_layers: int, positions: int) -> int:
        """The least skipped weight a candidate needs to be of use (knapsack.solve)."""
        return 1

    def calibrate(self, candidates: list[knapsack.Candidate], agree: list[int],
                  positions: int, raw: list[float]) -> list[float]:
        """The acceptance each candidate is chosen by (here: ``raw``, ``alpha_of`` the DP's
        ``agree`` of ``positions``)."""
        return list(raw)

    alpha_of = staticmethod(smoothed_alpha)  # (agree, total) -> a candidate's acceptance

    def selected(self, selection: Selection, raw: list[float], useful: int) -> None:
        """A selection was made (``raw``: its alphas before calibration)."""

    def spare(self) -> None:
        """A due selection is not run: plain decoding until the next."""
        self.plan_now = PLAIN

    def between_selections(self) -> Plan:
        """The plan of a round in which no selection runs."""
        return self.plan_now

    # ------------------------------------------------------------------ Selector

    def start(self, model: Transformer) -> None:
        if self.config.calibrate and self.calibration is None:  # kept across runs
            self.calibration = Calibration(self.pricing.at, model.cfg.num_layers, keep_online)
        # per row, per round observed: its committed positions' [2L+1, d] states
        self.states: dict[int, Sequence[list[torch.Tensor]]] = {}
        self.plan_now = PLAIN
        self.schedule.start()
        self.history = []

    def wants_reference(self) -> bool:
        """Hidden states are kept only in the rounds that feed the next selection (its last
        m rounds per row), not in every round."""
        return self.schedule.wanting

    def kept(self) -> deque[list[torch.Tensor]]:
        """A row's store of observed rounds: its last m."""
        return deque(maxlen=self.config.m)

    def observe(self, hidden: Capture, valid: list[int], rids: list[int]) -> None:
        for b, rid in enumerate(rids):
            stacked = torch.stack([h[b, :valid[b]] for h in hidden], dim=1)  # [valid, 2L+1, d]
            self.states.setdefault(rid, self.kept()).append(list(stacked.unbind(0)))

    def record(self, steps: int, verified: list[int], accepted: list[int]) -> None:
        """The rounds' yield sets how early the window of the next selection opens."""
        self.schedule.observe_round(statistics.fmean(accepted) + 1 if accepted else 1.0)

    def retire(self, rid: int) -> None:
        self.states.pop(rid, None)

    def plan(self, model: Transformer, batch: Batch) -> Plan:
        self.profile = self.price(batch.size)
        if self.schedule.tick(batch.progress):
            self.states.clear()  # only consecutive positions up to each row's end
        if self.schedule.due(batch.progress):
            context = round(statistics.fmean(batch.lengths))
            m = self.config.m  # rounds a DP judges on (their positions: r in all)
            ready = any(len(self.states.get(row.rid, ())) == m for row in batch.rows)
            if ready and self.nothing_pays(batch, context, model.cfg.num_layers,
                                           self.reference_positions(batch)):
                self.spare()
                self.schedule.skip(batch.progress)
                return self.plan_now
            references = self.references(batch) if ready else []
            if references:
                start = time.perf_counter()
                self.plan_now = self.select(model, batch, references).plan
                self.schedule.selected(batch.progress, time.perf_counter() - start,
                                       self.profile.verify_time(1, context))
                return self.plan_now
        return self.between_selections()

    # ------------------------------------------------------------------ the DP

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

    def select(self, model: Transformer, batch: Batch, references: list[Reference]) -> Selection:
        cfg, num_layers = self.config, model.cfg.num_layers
        n = round(statistics.fmean(batch.lengths))  # priced at the batch's mean context
        weights = self.weights(n, num_layers)
        keep = set()
        if cfg.keep_first_last:
            keep = {0, 1, 2 * num_layers - 2, 2 * num_layers - 1}
        evaluator = HiddenStateEvaluator(model, batch.cache, references)
        positions = evaluator.reference.shape[1]
        useful = self.useful_from(weights, n, num_layers, positions)
        candidates = knapsack.solve(weights, evaluator, tau=cfg.tau,
                                    max_skip_fraction=cfg.max_skip_fraction,
                                    always_execute=keep, coupled=cfg.coupled, useful_from=useful)
        agree = self._agreements(model, evaluator, candidates)
        raw = [self.alpha_of(a, positions) for a in agree]
        alphas = self.calibrate(candidates, agree, positions, raw)
        choice = self.choose(candidates, alphas, n, num_layers)
        skip = candidates[choice.candidate].skipped if choice.candidate is not None else frozenset()
        selection = Selection(n, weights, candidates, alphas, choice, Plan(skip, choice.gamma),
                              positions)
        self.selected(selection, raw, useful)
        self.predicted_tps = choice.tokens_per_time
        self.history.append(selection)
        self.selections += 1
        log.debug("selection at n=%d: %d candidates, chose %s gamma=%d (tpt %.1f tok/s)", n,
                  len(candidates), sorted(skip), choice.gamma, choice.tokens_per_time)
        return selection

    def _agreements(self, model: Transformer, evaluator: HiddenStateEvaluator,
                    candidates: list[knapsack.Candidate]) -> list[int]:
        """Per candidate, the reference positions where its top-1 token is the full model's."""
        if not candidates:
            return []
        states = evaluator.reference
        reference = model.logits(states[-1]).argmax(dim=-1)  # [M]
        finals = torch.stack([evaluator.current[c.skipped_weight] for c in candidates])
        return (model.logits(finals).argmax(dim=-1) == reference).sum(dim=-1).tolist()


class KnapSpecSelector(KnapsackSelector):
    """KnapSpec: sublayers weighed by their measured latency, the subnet and draft length
    chosen by Tokens-per-Time, a due DP spared where it cannot pay, the plan guarded."""

    def __init__(self, profiles: LatencyProfile | Sequence[LatencyProfile],
                 config: KnapSpecConfig = KnapSpecConfig()):
        super().__init__(profiles, config)
        self.guard = PlanGuard()
        self.book = AcceptanceBook()
        self.lower: list[float] = []  # the last estimates less their noise (calibrate)
        self.spare_rule = SpareRule(self.schedule, min_gain=config.min_gain,
                                    max_gamma=config.max_gamma,
                                    max_skip_fraction=config.max_skip_fraction)

    @property
    def priced(self) -> bool:
        """Whether rounds are priced against plain decoding (not under the alpha ablation)."""
        return self.config.objective == "tpt"

    @property
    def fallbacks(self) -> int:
        return self.guard.fallbacks

    def prices(self, num_layers: int) -> Prices:
        return Prices(self.profile, num_layers, self.guard.calibration)

    def start(self, model: Transformer) -> None:
        super().start(model)
        self.guard.start()
        self.book.start()
        self.lower = []

    def record(self, steps: int, verified: list[int], accepted: list[int]) -> None:
        super().record(steps, verified, accepted)
        self.guard.record(steps, verified, accepted, self.profile)
        if steps and self.plan_now.gamma:
            self.book.record(self.plan_now.skip, self.plan_now.gamma, verified, accepted)

    def nothing_pays(self, batch: Batch, n: int, num_layers: int, positions: int) -> bool:
        if not self.priced:
            return False  # the alpha objective does not price rounds: always select
        return self.spare_rule.nothing_pays(self.prices(num_layers), batch,
                                            self.weights(n, num_layers), n, positions)

    def useful_from(self, weights: list[int], n: int, num_layers: int, positions: int) -> int:
        """The least weight that could pay here or at a context up to RESELECT_GROWTH times
        longer (attention dearer, skipping it worth more): the subnets left out could then
        not pay anywhere this DP's frontier is reused (``SpareRule.frontier_rules_out``)."""
        if not self.priced:
            return 1
        prices = self.prices(num_layers)
        return min(self.spare_rule.least_paying_weight(prices, weights, c, positions)
                   for c in (n, math.ceil(n * SpareRule.RESELECT_GROWTH)))

    def calibrate(self, candidates: list[knapsack.Candidate], agree: list[int],
                  positions: int, raw: list[float]) -> list[float]:
        """Each candidate's posterior acceptance (speculation/acceptance.py): the DP's agreements and
        what this run's drafts with it and with the subnets near it realized. Keeps each
        estimate less ``noise_z`` of its spread for ``choose``'s margin."""
        estimates = [self.book.estimate(c.skipped, a, positions)
                     for c, a in zip(candidates, agree)]
        self.lower = [e.lower(self.config.noise_z) for e in estimates]
        return [e.mean for e in estimates]

    def choose(self, candidates: list[knapsack.Candidate], alphas: list[float], n: int,
               num_layers: int) -> tpt.Choice:
        """The TPT search, priced by this selector's profile at the round's batch size."""
        cfg, p = self.config, self.profile
        draft_times = [p.draft_time(c.skipped, n, num_layers) for c in candidates]
        lower = self.lower if len(self.lower) == len(candidates) else None
        return tpt.search(alphas, draft_times, lambda q: p.verify_time(q, n),
                          max_gamma=cfg.max_gamma, objective=cfg.objective,
                          exit_rate=self.book.exit_rate, lower=lower)

    def selected(self, selection: Selection, raw: list[float], useful: int) -> None:
        """Keep a fruitless DP's frontier; guard a speculative plan."""
        choice, n = selection.choice, selection.context
        plain = choice.candidate is None or not choice.gamma
        lower = self.lower if len(self.lower) == len(selection.candidates) else None
        self.spare_rule.frontier = Frontier(
            n, selection.weights, useful, [c.skipped for c in selection.candidates], raw,
            lower, self.spare_rule.fruitless(n)) if plain else None
        num_layers = len(selection.weights) // 2
        self.guard.watch(None if plain else PlanRun(
            n, raw[choice.candidate],
            self.profile.draft_time(selection.plan.skip, n, num_layers)))

    def spare(self) -> None:
        super().spare()
        self.guard.watch(None)

    def between_selections(self) -> Plan:
        if self.guard.drops(self.plan_now, self.profile):
            self.plan_now = PLAIN
        return self.plan_now
