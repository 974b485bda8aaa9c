"""KnapSpec selection: the knapsack DP over hidden states, then the Tokens-per-Time search.

The selector keeps the full model's hidden states (input of every sublayer and output of
every sublayer) at the last ``m`` committed positions, captured for free during verification.
Once ``m`` tokens have been generated, and then every ``interval`` generated tokens (stretched
while the DP is slow next to decoding, see ``interval``), it:

1. prices each sublayer from the latency profile at the current context length n
   (integer weights, attention growing with n, MLP constant, all-reduce included under TP);
2. runs the pure knapsack solver (knapsack.py); every stage evaluates all surviving budgets
   in one batched forward of that sublayer over the reference positions, attending to the
   real KV cache prefix, and scores them by mean cosine to the full model's state;
3. estimates each candidate's acceptance from top-1 agreement with the full model;
4. picks subnet and draft length by Tokens-per-Time (tpt.py), where gamma = 0 means plain
   autoregressive decoding until the next selection.

Between selections a guard (``PlanRun``) drops a plan for plain decoding once its drafts,
priced by the profile at the acceptance actually seen, yield fewer tokens per second than plain
decoding; the realized/predicted acceptance ratio calibrates the next selection's alphas.

The DP runs where the hidden states are (inside each TP rank, SPMD); nothing here is per token.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache import KVCache
from ..model import Attention, Capture, Transformer
from ..profiles.profile import LatencyProfile, integer_weights
from . import knapsack, tpt
from .selfspec import Plan, Selector

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnapSpecConfig:
    """The paper's defaults: D=10, tau=0.5, m=5, re-selection every 64 steps, weight cap 5."""

    max_gamma: int = 10  # D
    tau: float = 0.5  # prune DP states whose mean cosine is below this
    m: int = 5  # reference positions
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


@dataclass
class PlanRun:
    """What the speculative plan in force has yielded, priced by the profile: counts, not the
    wall clock, so every TP rank reaches the same decision without a broadcast."""

    context: int
    alpha: float  # the acceptance the DP estimated for it (before calibration)
    draft_time: float
    rounds: int = 0
    tokens: int = 0  # accepted drafts plus the verifier's token, over all rounds
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


class HiddenStateEvaluator:
    """The DP's tensors: one batched sublayer forward per (stage, execute) over all budgets."""

    def __init__(self, model: Transformer, cache: KVCache, states: torch.Tensor, start: int):
        self.model, self.cache = model, cache
        self.reference = states  # [2L + 1, m, d]: input, then after each item
        m = states.shape[1]
        self.prefix = start  # cache positions before the reference tokens
        positions = torch.arange(start, start + m, device=states.device)[None]
        self.step = model.step(positions, slice(0, 1))
        self.current: dict[int, torch.Tensor] = {0: states[0]}
        self.pending: dict[tuple[int, bool], torch.Tensor] = {}
        causal = torch.ones(m, m, dtype=torch.bool, device=states.device).tril()
        self.causal = causal

    def evaluate(self, item: int, sources: list[int], execute: bool) -> list[float]:
        x = torch.stack([self.current[j] for j in sources])
        if execute:
            layer = self.model.layers[item // 2]
            x = self._attention(layer.attention, item // 2, x) if item % 2 == 0 else layer.mlp(x)
        for j, state in zip(sources, x):
            self.pending[(j, execute)] = state
        target = self.reference[item + 1]
        cos = F.cosine_similarity(x.float(), target.float()[None], dim=-1).mean(dim=-1)
        return cos.tolist()

    def keep(self, item: int, chosen: dict[int, tuple[int, bool]]) -> None:
        self.current = {j: self.pending[src] for j, src in chosen.items()}
        self.pending = {}

    def _attention(self, attn: Attention, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Attention of N candidate states at the m reference positions: each attends to the
        cached prefix (the full model's K/V) and, causally, to its own K/V, as a draft would.
        The two parts are merged through the prefix's log-sum-exp."""
        n, m, _ = x.shape
        q, k, v = attn.qkv(attn.norm(x), self.step)
        kv, hd = attn.num_kv_heads, attn.head_dim
        g, scale = attn.num_heads // kv, attn.head_dim ** -0.5
        q = q.reshape(n, kv, g * m, hd)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [N, KV, m, hd]
        own = (q @ k.transpose(-1, -2)) * scale  # [N, KV, g*m, m]
        own = own.masked_fill(~self.causal.repeat(g, 1), float("-inf"))
        if not self.prefix:
            out = torch.softmax(own, dim=-1) @ v
        else:
            # All N states share the prefix: one attention per KV head with N folded into rows.
            rows = q.transpose(0, 1).reshape(1, kv, n * g * m, hd)
            out_p, lse = prefix_attention(rows, self.cache.k[layer][0:1, :, :self.prefix],
                                          self.cache.v[layer][0:1, :, :self.prefix], scale)
            out_p = out_p.reshape(kv, n, g * m, hd).transpose(0, 1)
            lse = lse.reshape(kv, n, g * m, 1).transpose(0, 1)
            top = torch.maximum(own.amax(dim=-1, keepdim=True), lse)
            w_own, w_prefix = (own - top).exp(), (lse - top).exp()
            out = (w_prefix * out_p + w_own @ v) / (w_prefix + w_own.sum(dim=-1, keepdim=True))
        out = out.reshape(n, attn.num_heads, m, hd).transpose(1, 2).reshape(n, m, -1)
        return x + attn.reduce(attn.o_proj(out.to(x.dtype)))


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention [1, KV, R, hd] over keys [1, KV, P, hd]: (output, log-sum-exp [1, KV, R]).

    On a CPU this is torch's fused flash kernel: with R = N budgets x m positions x group rows
    against an 8k prefix, plain ops stream a [KV, R, P] score matrix through memory five times
    per stage (SmolLM2 at 8k on two cores: 5.5 s per selection with plain ops, 1.3 s fused, same
    values to 3e-7). bf16 would be faster still (1.0 s) but changed 2 of 60 candidates.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, scale=scale)[:2]
        return out, lse
    return reference_prefix_attention(q, k, v, scale)


def reference_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in plain tensor ops (GPUs, and the check of the fused path in the tests)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    top = scores.amax(dim=-1, keepdim=True)
    weights = (scores - top).exp()
    total = weights.sum(dim=-1, keepdim=True)
    return (weights @ v) / total, (top + total.log()).squeeze(-1)


class KnapSpecSelector(Selector):
    """Re-selects the draft subnet and gamma from measured latency and hidden-state similarity."""

    def __init__(self, profile: LatencyProfile, config: KnapSpecConfig = KnapSpecConfig()):
        self.profile, self.config = profile, config
        self.history: list[Selection] = []
        self.selections = 0
        self.fallbacks = 0  # plans dropped for plain decoding by the guard (all sequences)
        self.search = self.local_search

    def start(self, model: Transformer, prompt_len: int) -> None:
        self.states: deque[torch.Tensor] = deque(maxlen=self.config.m)  # [2L+1, d] per position
        self.plan_now = Plan(frozenset(), 0)
        # The paper's reference is the hidden states of the tokens generated in the last m
        # steps: the first selection waits for m of them (m plain decode steps, which cost
        # nothing over ar) instead of judging drafts on the prompt's last positions -- with a
        # chat template those are the assistant header, a poor sample of what gets drafted.
        self.next_selection = self.config.m + 1  # generated-token count of the next selection
        self.history = []
        self.run: PlanRun | None = None
        self.accepted = self.expected = 0.0  # this sequence: accepted vs predicted drafts

    @property
    def calibration(self) -> float:
        """Realized over predicted acceptance of this sequence's drafts so far (1 before any;
        one pseudo-token on each side). The next selection's alphas are scaled by it: the DP's
        m-token estimate is biased, and the biased direction is what the draft rounds show."""
        return (self.accepted + 1.0) / (self.expected + 1.0)

    def record(self, drafted: int, accepted: int) -> None:
        run = self.run
        if run is None or not drafted:
            return
        run.rounds += 1
        run.tokens += accepted + 1
        run.modeled_s += (drafted * run.draft_time
                          + self.profile.verify_time(drafted + 1, run.context))
        self.accepted += accepted
        self.expected += run.alpha * drafted

    def wants_reference(self) -> bool:
        return True

    def observe(self, hidden: Capture, valid: int) -> None:
        stacked = torch.stack([h[0, :valid] for h in hidden], dim=1)  # [valid, 2L+1, d]
        self.states.extend(stacked.unbind(0))

    def plan(self, model: Transformer, cache: KVCache, generated: int) -> Plan:
        done_once = self.config.select_once and self.history
        if self.states and generated >= self.next_selection and not done_once:
            start = time.perf_counter()
            self.plan_now = self.select(model, cache).plan
            self.next_selection = generated + self.interval(time.perf_counter() - start,
                                                            cache.lengths[0])
        elif self.run is not None and self.run.losing(self.profile):
            log.info("plan %s gamma=%d yields %.2f tokens per round, below plain decoding at "
                     "this acceptance: plain decoding until the next selection",
                     sorted(self.plan_now.skip), self.plan_now.gamma,
                     self.run.tokens / self.run.rounds)
            self.plan_now, self.run = Plan(frozenset(), 0), None
            self.fallbacks += 1
        return self.plan_now

    def interval(self, select_s: float, n: int) -> int:
        """Tokens until the next selection: ``config.interval``, stretched when one selection
        costs more than ``overhead_budget`` of the decoding it steers (a CPU runs the batched
        DP slowly; a GPU does not), using the profile's time of one plain decode step."""
        step = self.profile.verify_time(1, n)
        needed = select_s / (self.config.overhead_budget * step) if step > 0 else 0
        return max(self.config.interval, math.ceil(needed))

    def select(self, model: Transformer, cache: KVCache) -> Selection:
        cfg, num_layers = self.config, model.cfg.num_layers
        n = cache.lengths[0]
        states = torch.stack(list(self.states), dim=1)  # [2L+1, m, d]
        start = n - states.shape[1]
        weights = ([1] * (2 * num_layers) if cfg.unit_weights
                   else integer_weights(self.profile, n, num_layers, cfg.weight_cap))
        keep = set()
        if cfg.keep_first_last:
            keep = {0, 1, 2 * num_layers - 2, 2 * num_layers - 1}
        evaluator = HiddenStateEvaluator(model, cache, states, start)
        candidates = knapsack.solve(weights, evaluator, tau=cfg.tau,
                                    max_skip_fraction=cfg.max_skip_fraction,
                                    always_execute=keep, coupled=cfg.coupled)
        raw = self._alphas(model, evaluator, states, candidates)
        alphas = [min(1.0, self.calibration * a) for a in raw]
        choice = self.choose(candidates, alphas, n, num_layers)
        skip = candidates[choice.candidate].skipped if choice.candidate is not None else frozenset()
        selection = Selection(n, weights, candidates, alphas, choice, Plan(skip, choice.gamma))
        guarded = cfg.fixed_gamma is None  # CLaSp, the baseline, drafts whatever it yields
        self.run = None if choice.candidate is None or not choice.gamma or not guarded else \
            PlanRun(n, raw[choice.candidate], self.profile.draft_time(skip, n, num_layers))
        self.history.append(selection)
        self.selections += 1
        log.debug("selection at n=%d: %d candidates, chose %s gamma=%d (tpt %.1f tok/s)", n,
                  len(candidates), sorted(skip), choice.gamma, choice.tokens_per_time)
        return selection

    def _alphas(self, model: Transformer, evaluator: HiddenStateEvaluator, states: torch.Tensor,
                candidates: list[knapsack.Candidate]) -> list[float]:
        if not candidates:
            return []
        reference = model.logits(states[-1]).argmax(dim=-1)  # [m]
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
        return self.search(candidates, alphas, n, num_layers)

    def local_search(self, candidates, alphas, n: int, num_layers: int) -> tpt.Choice:
        """The TPT search priced by this process's profile; the Ray runtime replaces
        ``self.search`` on rank 0 by a call to the coordinator, which holds the replica's."""
        cfg = self.config
        draft_times = [self.profile.draft_time(c.skipped, n, num_layers) for c in candidates]
        return tpt.search(alphas, draft_times, lambda q: self.profile.verify_time(q, n),
                          max_gamma=cfg.max_gamma, objective=cfg.objective,
                          min_gain=cfg.min_gain)


def build_selector(options, model: Transformer) -> KnapSpecSelector:
    """``options`` is a speculation.factory.StrategyOptions; the profile is found or measured."""
    from ..profiles.store import resolve_profile

    profile = resolve_profile(options.profile, model)
    if options.name == "clasp":
        config = KnapSpecConfig(interval=options.interval, coupled=True, unit_weights=True,
                                fixed_gamma=options.gamma, skip_layers=0.25)
    else:
        config = KnapSpecConfig(interval=options.interval, coupled=options.coupled,
                                objective=options.objective, select_once=options.select_once)
    return KnapSpecSelector(profile, config)
