"""SPMD strategies: every rank of a TP group runs the same strategy, with rank 0's plans.

Hidden states and logits are identical on every rank (see parallel/layers.py), so token
choices and acceptance agree by construction; the selector's plan, and the wall-clock
quantities its schedule depends on, are broadcast from rank 0 so that a divergent selection
can never desynchronize the collectives of the decode loop.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from knapspec_dist.model.decoder import Transformer
from knapspec_dist.parallel.comm import Comm
from knapspec_dist.speculation.calibration import RoundTiming
from knapspec_dist.speculation.selfspec import Plan

log = logging.getLogger(__name__)


def spmd_strategy(strategy, model: Transformer):
    """Make a strategy safe to run SPMD on every rank of a TP group: a self-speculative
    strategy's selector gets its plans broadcast from rank 0 (one tiny broadcast per round)."""
    tp = getattr(model, "tp", None)
    selector = getattr(strategy, "selector", None)
    if tp is None or tp.layout.world == 1 or selector is None or isinstance(selector, SyncedSelector):
        return strategy
    strategy.selector = SyncedSelector(selector, tp.comm)
    return strategy


class SyncedSelector:
    """Wraps a Selector: every rank runs it (its DP issues the same collectives everywhere),
    then rank 0's plan -- and the per-rank wall-clock quantities of its schedule
    (speculation/schedule.py: ``next_selection``, set from the measured selection time, and
    ``last_select_s``, which decides whether a DP is worth running) -- is broadcast, so all
    ranks draft with the same subnet and gamma and run the DP at the same steps. The last
    round's seconds ride on the same broadcast: every rank's calibration (speculation/calibration.py)
    is fed rank 0's, one round later, so all price the next selection alike; only rank 0's
    reports its refits (logs and saves the online profile: one file, not one per rank)."""

    SCHEDULE = {"next_selection": 1, "last_select_s": 1_000_000}  # name: integer scale
    NANOS = 1_000_000_000  # the round's seconds, broadcast in nanoseconds

    def __init__(self, inner, comm: Comm):
        self.inner, self.comm = inner, comm
        self.divergences = 0
        self.pending: RoundTiming | None = None  # this rank's last round, not yet fed

    def timed(self, timing: RoundTiming) -> None:
        self.pending = timing

    def __getattr__(self, name):  # selections, fallbacks, history, ...
        return getattr(self.inner, name)

    def start(self, model):
        out = self.inner.start(model)
        calibration = getattr(self.inner, "calibration", None)  # made at the first start
        if calibration is not None:
            calibration.leader = self.comm.rank == 0
        return out

    def wants_reference(self):
        return self.inner.wants_reference()

    def observe(self, hidden, valid, rids):
        return self.inner.observe(hidden, valid, rids)

    def retire(self, rid):
        return self.inner.retire(rid)

    def record(self, steps, verified, accepted):
        return self.inner.record(steps, verified, accepted)

    def plan(self, model, batch):
        plan = self.inner.plan(model, batch)
        schedule = getattr(self.inner, "schedule", None)  # a static selector has none
        names = list(self.SCHEDULE)
        code = torch.zeros(model.cfg.num_items + 3 + len(names), dtype=torch.int64)
        code[0] = plan.gamma
        for k, name in enumerate(names):  # -1: the selector has none (yet)
            value = getattr(schedule, name, None)
            code[1 + k] = -1 if value is None else int(value * self.SCHEDULE[name])
        timing = 1 + len(names)  # the last round's draft and verify seconds (-1: none)
        code[timing:timing + 2] = -1
        if self.pending is not None:
            code[timing] = round(self.pending.draft_s * self.NANOS)
            code[timing + 1] = round(self.pending.verify_s * self.NANOS)
        first = timing + 2
        if plan.skip:
            code[first + torch.tensor(sorted(plan.skip), dtype=torch.int64)] = 1
        if self.comm.cuda:
            code = code.cuda()
        self.comm.broadcast(code, src=0)
        code = code.cpu()
        agreed = Plan(frozenset(torch.nonzero(code[first:]).flatten().tolist()), int(code[0]))
        for k, name in enumerate(names):
            if schedule is not None:
                value, scale = int(code[1 + k]), self.SCHEDULE[name]
                setattr(schedule, name, None if value == -1 else
                        value if scale == 1 else value / scale)
        if self.pending is not None and int(code[timing]) >= 0:
            self.inner.timed(replace(self.pending, draft_s=int(code[timing]) / self.NANOS,
                                     verify_s=int(code[timing + 1]) / self.NANOS))
        self.pending = None
        if agreed != plan:
            self.divergences += 1
            log.warning("rank %d: selector plan %s differs from rank 0's %s; using rank 0's",
                        self.comm.rank, plan, agreed)
            if hasattr(self.inner, "plan_now"):
                self.inner.plan_now = agreed
        return agreed
