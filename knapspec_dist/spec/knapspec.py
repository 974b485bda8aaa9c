"""KnapSpec selection: the knapsack DP over hidden states, then the Tokens-per-Time search.

The selector keeps the full model's hidden states (input of every sublayer and output of
every sublayer) at the last ``m`` committed positions, captured for free during verification.
Once ``m`` tokens have been generated, and then every ``interval`` generated tokens (stretched
while the DP is slow next to decoding, see ``interval``), it:

1. prices each sublayer from the latency profile at the current context length n
   (integer weights, attention growing with n, MLP constant, all-reduce included under TP);
2. runs the pure knapsack solver (knapsack.py); every stage evaluates all surviving budgets
   in one batched forward of that sublayer over the reference positions, attending to the
   real KV cache prefix, and scores them by mean cosine to the full model's state
   (hidden_states.py); states that cannot reach the least skipped weight that could pay
   (``least_paying_weight``) are dropped, which leaves the choice unchanged;
3. estimates each candidate's acceptance from top-1 agreement with the full model;
4. picks subnet and draft length by Tokens-per-Time (tpt.py), where gamma = 0 means plain
   autoregressive decoding until the next selection.

A due selection is spared, and decoding stays plain, where the DP cannot pay for itself
(``nothing_pays``): no weight could pay at these prices, the batch has too few tokens left to
repay the last DP's cost, or the last fruitless DP's subnets, priced again at today's batch
size and context, still lose.

Between selections a guard (``PlanRun``) drops a plan for plain decoding once its drafts,
priced by the profile at the acceptance actually seen, yield fewer tokens per second than plain
decoding; the realized/predicted acceptance ratio calibrates the next selection's alphas.

The DP runs where the hidden states are (inside each TP rank, SPMD); nothing here is per token.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from knapspec_dist.model.decoder import Capture, Transformer
from knapspec_dist.profiles.batching import BatchPricing
from knapspec_dist.profiles.profile import LatencyProfile, integer_weights
from knapspec_dist.spec import knapsack, tpt
from knapspec_dist.engine.sequence import Batch
from knapspec_dist.spec.hidden_states import HiddenStateEvaluator, Reference
from knapspec_dist.spec.selfspec import Plan, Selector

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnapSpecConfig:
    """The paper's defaults: D=10, tau=0.5, m=5, re-selection every 64 steps, weight cap 5."""

    max_gamma: int = 10  # D
    tau: float = 0.5  # prune DP states whose mean cosine is below this
    m: int = 5  # reference positions (a row's last m tokens; in a batch, spread over rows)
    reference_rows: int = 2  # rows of a batch whose positions the DP judges drafts on
    interval: int = 64  # generated tokens between selections (at least)
    overhead_budget: float = 0.025  # stretch the interval so selection stays under this share
    min_gain: float = 1.05  # speculate only when predicted tokens/s beat plain decoding by this
    weight_cap: float = 5.0
    max_skip_fraction: float = 0.5
    keep_first_last: bool = True  # always execute the first and the last layer
    coupled: bool = False  # ablation: skip a layer's attention and MLP together
    objective: str = "tpt"  # "tpt" | "alpha" (ablation)
    select_once: bool = False  # ablation: select after prefill only
    unit_weights: bool = False  # CLaSp: every sublayer weighs 1 (layer-level with coupled)
    fixed_gamma: int | None = None  # CLaSp: fixed draft length instead of the TPT search
    skip_layers: float | None = None  # CLaSp: fraction of layers to skip


@dataclass
class Selection:
    """What one selection saw and chose (kept for stats and tests)."""

    context: int
    weights: list[int]
    candidates: list[knapsack.Candidate]
    alphas: list[float]
    choice: tpt.Choice
    plan: Plan


@dataclass(frozen=True)
class Frontier:
    """What a DP that chose plain decoding returned: its subnets and their raw acceptance,
    at context ``context``, weights ``weights``, subnets skipping less than ``useful_from``
    not evaluated. Priced again at a later batch size or context, it can spare the next DP."""

    context: int
    weights: list[int]
    useful_from: int
    skips: list[frozenset[int]]
    alphas: list[float]


@dataclass
class PlanRun:
    """What the speculative plan in force has yielded, priced by the profile: counts, not the
    wall clock, so every TP rank reaches the same decision without a broadcast."""

    context: int
    alpha: float  # the acceptance the DP estimated for it (before calibration)
    draft_time: float
    rounds: int = 0
    tokens: float = 0.0  # per row: accepted drafts plus the verifier's token, over all rounds
    modeled_s: float = 0.0

    GUARD_ROUNDS = 8  # judge a plan after this many draft/verify rounds

    def losing(self, profile: LatencyProfile) -> bool:
        """Slower than plain decoding at the acceptance actually seen (the guard that keeps
        the engine from staying slower than ``ar`` on a bad alpha estimate)."""
        if self.rounds < self.GUARD_ROUNDS:
            return False
        return self.tokens / self.modeled_s < 1.0 / profile.verify_time(1, self.context)


def smoothed_alpha(agree: int, total: int) -> float:
    """Acceptance estimate from ``agree`` of ``total`` top-1 matches, with a uniform prior.

    With m = 5 the raw ratio is 0 or 1 far too often; 5/5 becoming 6/7 keeps the TPT search
    from betting on ten-token drafts from five observations.
    """
    return (agree + 1) / (total + 2)


class KnapSpecSelector(Selector):
    """Re-selects the draft subnet and gamma from measured latency and hidden-state similarity."""

    def __init__(self, profile: LatencyProfile | Sequence[LatencyProfile],
                 config: KnapSpecConfig = KnapSpecConfig()):
        """``profile``: one latency profile, or several measured at different batch sizes
        (each round is priced at its batch size, profiles/batching.py)."""
        self.pricing, self.config = BatchPricing(profile), config
        self.profile = self.pricing.base  # the profile of the current batch size
        self.history: list[Selection] = []
        self.selections = 0
        self.fallbacks = 0  # plans dropped for plain decoding by the guard (all sequences)
        self.skipped = 0  # selections not run: no subnet could beat plain decoding
        # Kept across runs: what the last DP found when it found nothing worth drafting with,
        # what it cost, and the decoding rounds since (frontier_rules_out, worth_a_dp).
        self.frontier: Frontier | None = None
        self.last_select_s: float | None = None  # what the last DP cost (worth_a_dp)
        self.rounds_since_dp = 0
        self.accepted = self.expected = 0.0  # per run (start): accepted vs predicted drafts
        self.search = self.local_search

    def start(self, model: Transformer) -> None:
        self.states: dict[int, deque[torch.Tensor]] = {}  # per row: [2L+1, d] per position
        self.plan_now = Plan(frozenset(), 0)
        # The paper's reference is the hidden states of the tokens generated in the last m
        # steps: the first selection waits for m of them (m plain decode steps, which cost
        # nothing over ar) instead of judging drafts on the prompt's last positions -- with a
        # chat template those are the assistant header, a poor sample of what gets drafted.
        self.next_selection = self.config.m  # batch progress (tokens per row) at the first
        self._wants = True
        self.history = []
        self.run: PlanRun | None = None
        self.accepted = self.expected = 0.0  # this run: accepted vs predicted drafts

    @property
    def calibration(self) -> float:
        """Realized over predicted acceptance of this run's drafts so far (1 before any;
        one pseudo-token on each side). The next selection's alphas are scaled by it: the DP's
        m-token estimate is biased, and the biased direction is what the draft rounds show."""
        return (self.accepted + 1.0) / (self.expected + 1.0)

    def record(self, steps: int, verified: list[int], accepted: list[int]) -> None:
        run = self.run
        if run is None or not steps:
            return
        run.rounds += 1
        run.tokens += (sum(accepted) + len(accepted)) / len(accepted)
        run.modeled_s += steps * run.draft_time + self.profile.verify_time(steps + 1, run.context)
        self.accepted += sum(accepted)
        self.expected += run.alpha * sum(verified)

    def wants_reference(self) -> bool:
        """Hidden states are kept only in the rounds that feed the next selection (its last
        m positions per row), not in every round."""
        return self._wants

    def observe(self, hidden: Capture, valid: list[int], rids: list[int]) -> None:
        for b, rid in enumerate(rids):
            stacked = torch.stack([h[b, :valid[b]] for h in hidden], dim=1)  # [valid, 2L+1, d]
            self.states.setdefault(rid, deque(maxlen=self.config.m)).extend(stacked.unbind(0))

    def retire(self, rid: int) -> None:
        self.states.pop(rid, None)

    def references(self, batch: Batch) -> list[Reference]:
        """The last positions of up to ``reference_rows`` rows with m positions observed,
        longest context first (attention there is what the knapsack prices highest), m in all
        (the DP's cost grows with its positions: 3 + 2 over two rows costs what one row's 5
        does)."""
        m, found = self.config.m, []
        for slot, row in enumerate(batch.rows):
            states = self.states.get(row.rid)
            if states is not None and len(states) == m:
                found.append((batch.cache.lengths[slot], slot, list(states)))
        found = sorted(found, key=lambda f: -f[0])[:self.config.reference_rows]
        out = []
        for i, (end, slot, states) in enumerate(found):
            k = m // len(found) + (i < m % len(found))
            out.append(Reference(slot, end - k, torch.stack(states[-k:], dim=1)))
        return out

    def plan(self, model: Transformer, batch: Batch) -> Plan:
        self.profile = self.pricing.at(batch.size)
        self.rounds_since_dp += 1
        done_once = self.config.select_once and self.history
        wants = not done_once and batch.progress + self.config.m + 1 >= self.next_selection
        if wants and not self._wants:
            self.states.clear()  # only consecutive positions up to each row's end
        self._wants = wants
        return self._plan(model, batch)

    def _plan(self, model: Transformer, batch: Batch) -> Plan:
        done_once = self.config.select_once and self.history
        if batch.progress >= self.next_selection and not done_once:
            context = round(statistics.fmean(batch.lengths))
            m = self.config.m  # the positions a DP would judge on (references: m in all)
            ready = any(len(self.states.get(row.rid, ())) == m for row in batch.rows)
            if ready and self.nothing_pays(batch, context, model.cfg.num_layers, m):
                # Not even drafts that the DP could judge all right from the cheapest subnet
                # beat plain decoding here (a compute-bound batch), or the last DP's subnets
                # would not at these prices: plain decoding, and no DP to pay for.
                self.plan_now, self.run = Plan(frozenset(), 0), None
                self.skipped += 1
                self.next_selection = batch.progress + self.config.interval
                return self.plan_now
            references = self.references(batch) if ready else []
            if references:
                start = time.perf_counter()
                self.plan_now = self.select(model, batch, references).plan
                self.last_select_s = time.perf_counter() - start
                self.rounds_since_dp = 0
                self.next_selection = batch.progress + self.interval(self.last_select_s, context)
                return self.plan_now
        if self.run is not None and self.run.losing(self.profile):
            log.info("plan %s gamma=%d yields %.2f tokens per round, below plain decoding at "
                     "this acceptance: plain decoding until the next selection",
                     sorted(self.plan_now.skip), self.plan_now.gamma,
                     self.run.tokens / self.run.rounds)
            self.plan_now, self.run = Plan(frozenset(), 0), None
            self.fallbacks += 1
        return self.plan_now

    RESELECT_GROWTH = 1.25  # context growth that makes a fruitless selection worth redoing
    RECHECK_SHARE = 0.01  # ... and the share of decoding time a periodic re-check may cost

    def nothing_pays(self, batch: Batch, n: int, num_layers: int, positions: int) -> bool:
        """Whether a due selection can be spared: no subnet could beat plain decoding at
        context n and the current batch size's prices (``least_paying_weight`` past the cap),
        the most any subnet could save over the batch's remaining tokens is less than the last
        DP cost (``worth_a_dp``), or the last DP's frontier says so (``frontier_rules_out``)."""
        cfg = self.config
        if cfg.fixed_gamma is not None or cfg.objective != "tpt":
            return False  # CLaSp and the alpha objective do not price rounds: always select
        weights = self.weights(n, num_layers)
        cap = knapsack.skip_cap(weights, cfg.max_skip_fraction)
        return (self.least_paying_weight(weights, n, num_layers, positions) > cap
                or not self.worth_a_dp(batch, weights, n, num_layers, positions)
                or self.frontier_rules_out(n, num_layers, positions))

    def best_rate(self, weights: list[int], n: int, num_layers: int, positions: int
                  ) -> Callable[[int], float]:
        """j -> the most tokens/s a subnet skipping weight j (of ``weights``) could decode at
        at context n: drafting at the highest acceptance the DP can estimate from
        ``positions`` reference positions (all agree, then calibrated), and saving j times the
        most time one unit of weight stands for. Increasing in j."""
        cfg, p = self.config, self.profile
        alpha = min(1.0, self.calibration * smoothed_alpha(positions, positions))
        times = (p.attention_time(n), p.mlp_time())
        per_weight = max(times[i % 2] / w for i, w in enumerate(weights))
        full = p.draft_time(frozenset(), n, num_layers)

        def rate(j: int) -> float:
            draft = max(p.head, full - j * per_weight)
            return max(tpt.tokens_per_time(alpha, g, draft, lambda q: p.verify_time(q, n))
                       for g in range(1, cfg.max_gamma + 1))
        return rate

    def least_paying_weight(self, weights: list[int], n: int, num_layers: int,
                            positions: int) -> int:
        """The least skipped weight (of ``weights``) with which a subnet could beat plain
        decoding by ``min_gain`` at context n (``best_rate``); ``sum(weights) + 1`` when no
        weight can. The DP drops states that cannot reach it (knapsack.solve's
        ``useful_from``); where it is past the cap the DP is not run."""
        cfg, p = self.config, self.profile
        if cfg.fixed_gamma is not None or cfg.objective != "tpt":
            return 1
        rate = self.best_rate(weights, n, num_layers, positions)
        needed = cfg.min_gain / p.verify_time(1, n)
        lo, hi = 1, sum(weights) + 1  # the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if rate(mid) >= needed else (mid + 1, hi)
        return lo

    def worth_a_dp(self, batch: Batch, weights: list[int], n: int, num_layers: int,
                   positions: int) -> bool:
        """Whether the most a DP could save, drafting from the cheapest subnet at the best
        rate (``best_rate``) until the batch's longest remaining row is done, exceeds what
        the last DP cost. Before any DP: yes (nothing to predict its cost from). It spares the
        DPs of a batch's last tokens, e.g. a job's tail, where rows finish and the batch
        shrinks."""
        if self.last_select_s is None or not batch.rows:
            return True
        cap = knapsack.skip_cap(weights, self.config.max_skip_fraction)
        step = self.profile.verify_time(1, n)
        best = self.best_rate(weights, n, num_layers, positions)(cap)
        remaining = max(r.limit - len(r.out) for r in batch.rows)
        return remaining * step * max(0.0, 1.0 - 1.0 / (step * best)) > self.last_select_s

    def frontier_rules_out(self, n: int, num_layers: int, positions: int) -> bool:
        """The last DP chose plain decoding at a context within ``RESELECT_GROWTH`` of n, and
        at today's prices (batch size, context, calibration) neither the subnets it returned
        nor the ones it did not (which skipped less than its ``useful_from``) could pay. It is
        redone anyway once the decoding since, priced by the profile, reaches the DP's cost
        over ``RECHECK_SHARE`` (other rows, other text). Rows of similar length pay for one DP,
        not one each."""
        f = self.frontier
        if f is None or n > self.RESELECT_GROWTH * f.context:
            return False
        decoded = self.rounds_since_dp * self.profile.verify_time(1, n)  # priced: rank-equal
        if decoded * self.RECHECK_SHARE >= (self.last_select_s or 0.0):
            return False  # the rows have changed enough since: check again, at 1 % of time
        p = self.profile
        if f.skips:
            alphas = [min(1.0, self.calibration * a) for a in f.alphas]
            times = [p.draft_time(skip, n, num_layers) for skip in f.skips]
            choice = tpt.search(alphas, times, lambda q: p.verify_time(q, n),
                                max_gamma=self.config.max_gamma, min_gain=self.config.min_gain)
            if choice.candidate is not None:
                return False
        return self.least_paying_weight(f.weights, n, num_layers, positions) >= f.useful_from

    def weights(self, n: int, num_layers: int) -> list[int]:
        if self.config.unit_weights:
            return [1] * (2 * num_layers)
        return integer_weights(self.profile, n, num_layers, self.config.weight_cap)

    def interval(self, select_s: float, n: int) -> int:
        """Tokens until the next selection: ``config.interval``, stretched when one selection
        costs more than ``overhead_budget`` of the decoding it steers (a CPU runs the batched
        DP slowly; a GPU does not), using the profile's time of one plain decode step."""
        step = self.profile.verify_time(1, n)
        needed = select_s / (self.config.overhead_budget * step) if step > 0 else 0
        return max(self.config.interval, math.ceil(needed))

    def select(self, model: Transformer, batch: Batch, references: list[Reference]) -> Selection:
        cfg, num_layers = self.config, model.cfg.num_layers
        n = round(statistics.fmean(batch.lengths))  # priced at the batch's mean context
        weights = self.weights(n, num_layers)
        keep = set()
        if cfg.keep_first_last:
            keep = {0, 1, 2 * num_layers - 2, 2 * num_layers - 1}
        evaluator = HiddenStateEvaluator(model, batch.cache, references)
        # The least weight that could pay here or at a context up to RESELECT_GROWTH times
        # longer (attention dearer, skipping it worth more): the subnets left out could then
        # not pay anywhere this DP's frontier is reused (frontier_rules_out).
        positions = evaluator.reference.shape[1]
        useful = min(self.least_paying_weight(weights, c, num_layers, positions)
                     for c in (n, math.ceil(n * self.RESELECT_GROWTH)))
        candidates = knapsack.solve(weights, evaluator, tau=cfg.tau,
                                    max_skip_fraction=cfg.max_skip_fraction,
                                    always_execute=keep, coupled=cfg.coupled, useful_from=useful)
        raw = self._alphas(model, evaluator, candidates)
        alphas = [min(1.0, self.calibration * a) for a in raw]
        choice = self.choose(candidates, alphas, n, num_layers)
        skip = candidates[choice.candidate].skipped if choice.candidate is not None else frozenset()
        selection = Selection(n, weights, candidates, alphas, choice, Plan(skip, choice.gamma))
        self.frontier = Frontier(n, weights, useful, [c.skipped for c in candidates], raw) \
            if choice.candidate is None or not choice.gamma else None
        guarded = cfg.fixed_gamma is None  # CLaSp, the baseline, drafts whatever it yields
        self.run = None if choice.candidate is None or not choice.gamma or not guarded else \
            PlanRun(n, raw[choice.candidate], self.profile.draft_time(skip, n, num_layers))
        self.history.append(selection)
        self.selections += 1
        log.debug("selection at n=%d: %d candidates, chose %s gamma=%d (tpt %.1f tok/s)", n,
                  len(candidates), sorted(skip), choice.gamma, choice.tokens_per_time)
        return selection

    def _alphas(self, model: Transformer, evaluator: HiddenStateEvaluator,
                candidates: list[knapsack.Candidate]) -> list[float]:
        if not candidates:
            return []
        states = evaluator.reference
        reference = model.logits(states[-1]).argmax(dim=-1)  # [M]
        finals = torch.stack([evaluator.current[c.skipped_weight] for c in candidates])
        agree = (model.logits(finals).argmax(dim=-1) == reference).sum(dim=-1).tolist()
        return [smoothed_alpha(a, states.shape[1]) for a in agree]

    def choose(self, candidates, alphas, n: int, num_layers: int) -> tpt.Choice:
        cfg = self.config
        if cfg.fixed_gamma is not None:  # CLaSp: a fixed share of layers, a fixed gamma
            if not candidates:
                return tpt.Choice(None, 0, 0.0)
            target = 2 * round((cfg.skip_layers or 0.0) * num_layers)
            best = min(range(len(candidates)),
                       key=lambda k: (abs(len(candidates[k].skipped) - target), -alphas[k]))
            return tpt.Choice(best, cfg.fixed_gamma, 0.0)
        return self.search(candidates, alphas, n, num_layers, self.profile.batch)

    def local_search(self, candidates, alphas, n: int, num_layers: int,
                     batch: int = 1) -> tpt.Choice:
        """The TPT search priced by this process's profile; the Ray runtime replaces
        ``self.search`` on rank 0 by a call to the coordinator, which holds the replica's."""
        cfg = self.config
        draft_times = [self.profile.draft_time(c.skipped, n, num_layers) for c in candidates]
        return tpt.search(alphas, draft_times, lambda q: self.profile.verify_time(q, n),
                          max_gamma=cfg.max_gamma, objective=cfg.objective,
                          min_gain=cfg.min_gain)


def build_selector(options, model: Transformer) -> KnapSpecSelector:
    """``options`` is a speculation.factory.StrategyOptions; the profile is found or measured
    (with the stored profiles at other batch sizes beside it), or ``options.profile`` is a
    list of profiles at several batch sizes."""
    from knapspec_dist.profiles.store import batch_siblings, resolve_profile

    if isinstance(options.profile, (list, tuple)):
        profile = list(options.profile)
    else:
        profile = resolve_profile(options.profile, model)
        if options.profile is None:
            profile = [profile, *batch_siblings(profile)]
    if options.name == "clasp":
        config = KnapSpecConfig(interval=options.interval, coupled=True, unit_weights=True,
                                fixed_gamma=options.gamma, skip_layers=0.25)
    else:
        config = KnapSpecConfig(interval=options.interval, coupled=options.coupled,
                                objective=options.objective, select_once=options.select_once)
    return KnapSpecSelector(profile, config)
