"""Self-speculative decoding: the model drafts with a subset of its sublayers, then verifies.

One round: draft up to gamma tokens with the sublayers in ``plan.skip`` skipped (the draft
writes K/V only for the attention sublayers it runs), stopping early once every row has drafted
a token whose draft top-1 probability falls below ``tau_conf`` (the runner's ``early_exit``);
verify the pending token and all drafts in one full forward (which overwrites every layer's K/V
at those positions); keep the longest accepted prefix plus one target token (sampled drafts:
coupled or rejection sampling, engine/sampling.py), and roll the cache back by moving its
length. A ``Selector`` chooses the plan: fixed (``static``), or re-chosen
from the full model's hidden states (``knapspec``, ``clasp``).
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from knapspec_dist.clock import Clock
from knapspec_dist.engine.generation import GenerationConfig, PlanTally, finish
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.ragged import ragged_verify
from knapspec_dist.engine.rejection import accept_rejection
from knapspec_dist.engine.sampling import SamplingConfig, accept, choose, confidence
from knapspec_dist.engine.sequence import Batch, RoundInputs
from knapspec_dist.engine.strategy import Strategy
from knapspec_dist.model.decoder import Capture, Transformer
from knapspec_dist.model.paged_cache import PagedKVCache
from knapspec_dist.model.transfer import upload
from knapspec_dist.profiles.profile import LatencyProfile
from knapspec_dist.speculation.calibration import RoundTiming
from knapspec_dist.speculation.lookup import CopiedDrafts, CopiedRound, VerifyPrices
from knapspec_dist.speculation.options import format_skip


@dataclass(frozen=True)
class Plan:
    skip: frozenset[int]  # sublayer items the draft skips (2l attention, 2l+1 MLP)
    gamma: int  # draft length; 0 means a plain autoregressive step

    @property
    def label(self) -> str:
        """``a3,m5@4`` (``ar``: plain decoding), as the per-plan stats name it."""
        return f"{format_skip(self.skip)}@{self.gamma}" if self.gamma else "ar"


class Selector(ABC):
    """Chooses the draft plan of each round, one plan for every row of the batch."""

    def start(self, model: Transformer) -> None:
        """A batch run begins."""

    def wants_reference(self) -> bool:
        return False

    def observe(self, hidden: Capture, valid: list[int], rids: list[int]) -> None:
        """Full-model hidden states [B, T, d] of the last verify; row b kept its first
        ``valid[b]`` positions. ``rids`` name the rows in batch order."""

    def retire(self, rid: int) -> None:
        """Row ``rid`` finished."""

    def record(self, drafts: int, verified: list[int], accepted: list[int]) -> None:
        """One round under the current plan: ``drafts`` draft forwards; row b had
        ``verified[b]`` drafts judged and kept ``accepted[b]``."""

    def copied(self, won: bool) -> None:
        """Whether copied drafts won this round (over plain decoding and the plan's subnet):
        the rounds they win are not a subnet's to save time in."""

    def timed(self, timing: RoundTiming) -> None:
        """The seconds the last round took (speculation/calibration.py refits prices from them)."""

    def predicted_rate(self, plan: Plan, context: int) -> float | None:
        """Tokens per second per row the selection predicted for ``plan`` (None: no price)."""
        return None

    def round_prices(self, batch: int) -> LatencyProfile | None:
        """What prices a round of ``batch`` rows now, where the selector holds checked prices
        (copied drafts are priced by them); None: no prices to draft on."""
        return None

    @abstractmethod
    def plan(self, model: Transformer, batch: Batch) -> Plan:
        """The plan for the next round of ``batch``."""

    selections: int = 0
    fallbacks: int = 0


def verify_prices(profile: LatencyProfile, context: int, cache) -> VerifyPrices:
    """A copied round's verify prices at ``context`` (lookup.py). Ragged where the cache is
    paged: its tokens cost as many padded ones, but each reads its row's keys on its own,
    so its context part is a one-token verify's per token."""
    keys = profile.verify_time(1, context) - profile.verify_time(1, 0)

    def padded(q: float) -> float:
        return profile.verify_time(q, context)

    def ragged(per_row: float) -> float:
        return per_row * keys + profile.verify_time(per_row, 0)

    return VerifyPrices(padded, ragged if isinstance(cache, PagedKVCache) else None)


class StaticSelector(Selector):
    """A user-given skip set and draft length, for every round."""

    def __init__(self, skip: frozenset[int], gamma: int):
        self.fixed = Plan(frozenset(skip), gamma)

    def plan(self, model: Transformer, batch: Batch) -> Plan:
        return self.fixed



class SelfSpeculative(Strategy):
    """Draft with a subnet of the model, or copy drafts from each row's own tokens
    (``copied``, lookup.py), verify with the whole model; every row at once."""

    def __init__(self, selector: Selector, tau_conf: float = 0.7, name: str = "static",
                 copied: CopiedDrafts | None = None):
        self.selector, self.tau_conf, self.name = selector, tau_conf, name
        self.copied = copied

    def start(self, model: Transformer) -> None:
        self.selector.start(model)
        if self.copied is not None:
            self.copied.start()

    def retired(self, rid: int) -> None:
        self.selector.retire(rid)
        if self.copied is not None:
            self.copied.retire(rid)

    def copies(self, batch: Batch, plan: Plan) -> CopiedRound | None:
        """This round's copied drafts, where the selector's prices say they beat both plain
        decoding and ``plan``'s subnet (its predicted rate)."""
        profile = self.selector.round_prices(batch.size) if self.copied is not None else None
        if profile is None:
            return None
        n = round(statistics.fmean(batch.lengths))
        size = batch.size
        rival = size / profile.verify_time(1, n)
        if plan.gamma:
            rival = max(rival, size * (self.selector.predicted_rate(plan, n) or 0.0))
        room = [max(r.limit - len(r.out) - 1, 0) for r in batch.rows]
        return self.copied.plan(batch.rows, room, verify_prices(profile, n, batch.cache), rival)

    @torch.inference_mode()
    def round(self, model: Transformer, batch: Batch, config: GenerationConfig,
              forward: ModelRunner, timer: Clock) -> None:
        """Draft up to gamma tokens for every row with the plan's subnet, verify all rows'
        pending token and drafts in one forward, accept per row, roll back per row."""
        sampling, sel, dev = config.sampling, self.selector, model.device
        rows, cache = batch.rows, batch.cache
        size = len(rows)
        t0 = timer.mark()  # CUDA events on a GPU: timing never waits for the device
        selections, fallbacks = sel.selections, sel.fallbacks
        plan = sel.plan(model, batch)
        copied = self.copies(batch, plan)
        if self.copied is not None:
            sel.copied(copied is not None)
        if copied is not None:
            plan = Plan(frozenset(), 0)  # no draft forward: the verify judges the copies
        t1 = timer.mark()
        lengths = batch.lengths
        gamma = min(plan.gamma, max(r.limit - len(r.out) - 1 for r in rows))
        inputs = batch.inputs(dev)  # the round's one upload; drafts and verify share its noise
        if copied is None:
            drafts, cap, draft_logits = self._draft(forward, cache, plan.skip, inputs, lengths,
                                                    gamma, sampling)
        else:
            drafts, cap = self._copied(copied, rows, dev)
        t2 = timer.mark()
        capture = Capture() if sel.wants_reference() else None
        if copied is not None and copied.ragged:
            logits = ragged_verify(forward, cache, [[r.out[-1]] + d for r, d in
                                                    zip(rows, copied.drafts)], lengths, capture)
        else:
            logits = forward(torch.cat([inputs.pending, drafts], dim=1), lengths, cache,
                             slice(0, size), capture=capture, starts_dev=inputs.starts)
        if copied is not None and sampling.method == "rejection" and not sampling.greedy:
            # a copied token is a proposal of probability 1: kept with the target's
            draft_logits = torch.full_like(logits[:, :-1], float("-inf")).scatter_(
                -1, drafts[..., None], 0.0)
        elif copied is not None:
            draft_logits = None
        if draft_logits is None:
            n, nxt = accept(drafts, logits, sampling, inputs.seeds, inputs.index, cap)
        else:
            n, nxt = accept_rejection(drafts, draft_logits, logits, sampling, inputs.seeds,
                                      inputs.index, cap)
        before = [len(r.out) for r in rows]
        # The round's one read-back: per row, accepted count, next token, drafts judged, drafts.
        back = torch.cat([n[:, None], nxt[:, None], cap[:, None], drafts], dim=1).tolist()
        accepted, verified = [x[0] for x in back], [x[2] for x in back]
        for b, row in enumerate(rows):
            k = accepted[b]
            cache.commit(b, lengths[b] + k + 1)
            row.out, row.reason = finish(row.out + back[b][3:3 + k] + [back[b][1]], row.limit,
                                         model, config)
        if capture is not None:
            sel.observe(capture, [k + 1 for k in accepted], [r.rid for r in rows])
        if copied is None:
            sel.record(drafts.shape[1], verified, accepted)
        else:  # no subnet drafted: the selector sees the round's yield only
            sel.record(0, verified, accepted)
            self.copied.record(copied, verified, accepted)
        t3 = timer.mark()
        timer.sync()  # after the read-back the queue is empty: this costs nothing
        attn = sum(1 for i in plan.skip if i % 2 == 0)
        select_s, draft_s, verify_s = (timer.seconds(t0, t1), timer.seconds(t1, t2),
                                       timer.seconds(t2, t3))
        context = round(statistics.fmean(lengths))
        width = drafts.shape[1]
        # a ragged verify is timed as a padded one of its tokens per row (rounded), never
        # as a plain step's (the price copies are weighed against)
        fed = max(1, round(copied.tokens / size) - 1) if copied else 0
        sel.timed(RoundTiming(size, context, plan.skip, 0 if copied else width, draft_s,
                              verify_s, copied=fed))
        rate = (copied.tokens_per_s / size if copied else sel.predicted_rate(plan, context))
        round_s = draft_s + verify_s
        label = plan.label  # one plan for every row: copy@K, a ragged one copy@<=K
        if copied:
            label = f"copy@<={width}" if copied.ragged else f"copy@{width}"
        for b, row in enumerate(rows):
            s = row.stats
            s.select_s += select_s
            s.draft_s += draft_s
            s.verify_s += verify_s
            s.drafted += verified[b]
            s.accepted += accepted[b]
            if copied is not None:
                s.copied_drafted += verified[b]
                s.copied_accepted += accepted[b]
            s.selections += sel.selections - selections
            s.fallbacks += sel.fallbacks - fallbacks
            s.attention_skipped += verified[b] * attn  # the scheduler divides by drafted
            s.mlp_skipped += verified[b] * (len(plan.skip) - attn)
            tally = s.plans.setdefault(label, PlanTally())
            tally.add(len(row.out) - before[b], round_s, rate)

    @staticmethod
    def _copied(copied: CopiedRound, rows, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """The copies as drafts [B, q-1] (a row with fewer padded with its last token, never
        judged) and how many of each row's to judge [B], in one upload."""
        width = copied.q - 1
        packed = upload([[len(d)] + d + [row.out[-1]] * (width - len(d))
                         for d, row in zip(copied.drafts, rows)], dev)
        return packed[:, 1:], packed[:, 0]

    def _draft(self, forward: ModelRunner, cache, skip: frozenset[int], inputs: RoundInputs,
               lengths: list[int], gamma: int, sampling: SamplingConfig):
        """Up to ``gamma`` draft tokens per row [B, g], on the device (sampled ones with the
        row's noise at their output index), how many of each row's drafts to verify [B]:
        all it drafted, up to its room, and under rejection sampling the logits the drafts
        were drawn from [B, g, V] (else None). Every row drafts in the same forwards. With the
        runner's ``early_exit``, drafting stops once every row has a draft whose top-1
        probability is below ``tau_conf`` (one read-back per draft token); without it all
        ``gamma`` are drafted and the round never waits on the host. Either way each row's
        drafts are verified up to its first mismatch, an unsure one included: acceptance is
        lossless whatever is verified, and a later draft that matches is a token gained."""
        model = forward.model
        dev, size = model.device, inputs.pending.shape[0]
        rows = slice(0, size)
        tok, drafts, kept = inputs.pending, [], []
        rejection = sampling.method == "rejection" and not sampling.greedy
        unsure = torch.zeros(size, dtype=torch.bool, device=dev)
        for i in range(gamma):
            logits = forward(tok, [n + i for n in lengths], cache, rows, skip=skip,
                             starts_dev=inputs.starts + i)[:, -1]
            d = choose(logits, sampling, inputs.seeds, inputs.index + i)
            drafts.append(d)
            if rejection:
                kept.append(logits.clone())  # a captured graph's output is overwritten
            tok = d[:, None]
            if forward.early_exit:
                unsure |= confidence(logits, sampling) < self.tau_conf
                if bool(unsure.all()):
                    break
        if not drafts:
            return (torch.empty(size, 0, dtype=torch.long, device=dev),
                    torch.zeros(size, dtype=torch.long, device=dev), None)
        return (torch.stack(drafts, dim=1).long(), inputs.room.clamp(max=len(drafts)),
                torch.stack(kept, dim=1) if kept else None)
