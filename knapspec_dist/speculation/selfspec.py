"""Self-speculative decoding: the model drafts with a subset of its sublayers, then verifies.

One round: draft up to gamma tokens with the sublayers in ``plan.skip`` skipped (the draft
writes K/V only for the attention sublayers it runs), stopping early after a token whose
draft top-1 probability falls below ``tau_conf``; verify the pending token and all drafts in
one full forward (which overwrites every layer's K/V at those positions); keep the longest agreeing
prefix plus one target token, and roll the cache back by moving its length. A ``Selector``
chooses the plan: fixed (``static``), or re-chosen from the full model's hidden states
(``knapspec``, ``clasp``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..cache import KVCache, kv_heads
from ..model import Capture, Transformer
from ..sampling import accept_greedy, accept_sampling, choose, probabilities
from .autoregressive import prefill
from .strategy import (GenerationConfig, GenerationResult, GenerationStats, Strategy, Timer,
                       check_prompt, finish)

MAX_GAMMA = 16  # cache headroom for drafts beyond the generation limit


@dataclass(frozen=True)
class Plan:
    skip: frozenset[int]  # sublayer items the draft skips (2l attention, 2l+1 MLP)
    gamma: int  # draft length; 0 means a plain autoregressive step


class Selector(ABC):
    """Chooses the draft plan for each round of one sequence."""

    def start(self, model: Transformer, prompt_len: int) -> None:
        """A new sequence begins."""

    def wants_reference(self) -> bool:
        return False

    def observe(self, hidden: Capture, valid: int) -> None:
        """Full-model hidden states of the last forward; its first ``valid`` positions were kept."""

    def record(self, drafted: int, accepted: int) -> None:
        """One verify round under the current plan: ``accepted`` of ``drafted`` tokens kept."""

    @abstractmethod
    def plan(self, model: Transformer, cache: KVCache, generated: int) -> Plan:
        """The plan for the next round; ``generated`` tokens have been emitted so far."""

    selections: int = 0
    fallbacks: int = 0


class StaticSelector(Selector):
    """A user-given skip set and draft length, for every round."""

    def __init__(self, skip: frozenset[int], gamma: int):
        self.fixed = Plan(frozenset(skip), gamma)

    def plan(self, model: Transformer, cache: KVCache, generated: int) -> Plan:
        return self.fixed


def validate_plan(plan: Plan, num_items: int) -> None:
    bad = [i for i in plan.skip if not 0 <= i < num_items]
    if bad:
        raise ValueError(f"skip items {sorted(bad)} outside 0..{num_items - 1}")
    if not 0 <= plan.gamma <= MAX_GAMMA:
        raise ValueError(f"gamma {plan.gamma} outside 0..{MAX_GAMMA}")


class SelfSpeculative(Strategy):
    """Draft with a subnet of the model, verify with the whole model; one sequence at a time."""

    def __init__(self, selector: Selector, tau_conf: float = 0.7, name: str = "static"):
        self.selector, self.tau_conf, self.name = selector, tau_conf, name

    def generate(self, model: Transformer, prompts: list[list[int]],
                 config: GenerationConfig) -> list[GenerationResult]:
        return [self.generate_one(model, p, config) for p in prompts]

    @torch.inference_mode()
    def generate_one(self, model: Transformer, prompt: list[int],
                     config: GenerationConfig) -> GenerationResult:
        limit = check_prompt(model, prompt, config)
        sel, dev = self.selector, model.device
        timer = Timer(dev)
        start = timer.now()
        cache = KVCache(model.cfg, 1, len(prompt) + limit + MAX_GAMMA + 2,
                        dtype=model.dtype, device=dev,
                        kv_heads=kv_heads(model))
        gen = config.sampling.generator()
        sel.start(model, len(prompt))
        first = prefill(model, cache, 0, prompt)  # selectors observe generated tokens only
        out = choose(first[None], config.sampling, gen).tolist()
        prefill_s = timer.now() - start
        result = self.decode(model, cache, out, limit, config, gen)
        result.stats.prompt_tokens, result.stats.prefill_s = len(prompt), prefill_s
        result.stats.wall_s = timer.now() - start
        return result

    @torch.inference_mode()
    def decode(self, model: Transformer, cache: KVCache, out: list[int], limit: int,
               config: GenerationConfig, gen: torch.Generator | None = None) -> GenerationResult:
        """Draft/verify rounds from a prefilled row 0 whose first new token is ``out``; the
        stats' ``wall_s`` covers these rounds only. Benchmarks call it directly to run several
        plans from one prefill (the cache rolls back to any length, see ``cache.commit``)."""
        sampling, sel, dev = config.sampling, self.selector, model.device
        timer = Timer(dev)
        start = timer.now()
        stats = GenerationStats()
        selections0, fallbacks0 = sel.selections, sel.fallbacks
        out, reason = finish(list(out), limit, model, config)
        attn_skipped = mlp_skipped = 0
        while reason is None:
            t0 = timer.now()
            plan = sel.plan(model, cache, len(out))
            t1 = timer.now()
            pos = cache.lengths[0]
            drafts: list[int] = []
            draft_probs: list[torch.Tensor] = []
            tok = out[-1]
            for i in range(min(plan.gamma, limit - len(out) - 1)):
                logits = model(torch.tensor([[tok]], device=dev),
                               torch.tensor([[pos + i]], device=dev), cache, skip=plan.skip)[0, -1]
                q = probabilities(logits, sampling)
                tok = int(logits.argmax()) if sampling.greedy else \
                    int(torch.multinomial(q, 1, generator=gen))
                drafts.append(tok)
                draft_probs.append(q)
                if float(q.max()) < self.tau_conf:
                    break  # unsure: verify what is drafted (the draft step is not wasted)
            t2 = timer.now()
            capture = Capture() if sel.wants_reference() else None
            tokens = torch.tensor([[out[-1]] + drafts], device=dev)
            logits = model(tokens, cache.positions(slice(0, 1), len(drafts) + 1, dev), cache,
                           capture=capture)[0]
            if sampling.greedy:
                n, nxt = accept_greedy(drafts, logits)
            else:
                n, nxt = accept_sampling(drafts, draft_probs, logits, sampling, gen)
            cache.commit(0, pos + n + 1)
            if capture is not None:
                sel.observe(capture, n + 1)
            sel.record(len(drafts), n)
            out, reason = finish(out + drafts[:n] + [nxt], limit, model, config)
            t3 = timer.now()
            stats.select_s += t1 - t0
            stats.draft_s += t2 - t1
            stats.verify_s += t3 - t2
            stats.steps += 1
            stats.drafted += len(drafts)
            stats.accepted += n
            attn_skipped += len(drafts) * sum(1 for i in plan.skip if i % 2 == 0)
            mlp_skipped += len(drafts) * sum(1 for i in plan.skip if i % 2 == 1)
        stats.wall_s = timer.now() - start
        stats.new_tokens = len(out)
        stats.selections = sel.selections - selections0
        stats.fallbacks = sel.fallbacks - fallbacks0
        if stats.drafted:
            stats.attention_skipped = attn_skipped / stats.drafted
            stats.mlp_skipped = mlp_skipped / stats.drafted
        return GenerationResult(out, stats, reason)
