"""SPMD strategies: every rank of a TP group runs the same strategy, with rank 0's decisions.

Hidden states and logits are identical on every rank (see parallel/layers.py), so token
choices and acceptance agree by construction; the selector's ``Decision`` (its plan, and the
wall-clock quantities its schedule depends on) is broadcast from rank 0 and adopted by every
rank, so that a divergent selection can never desynchronize the collectives of the decode
loop.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from knapspec_dist.model.decoder import Transformer
from knapspec_dist.parallel.comm import Comm
from knapspec_dist.speculation.calibration import RoundTiming
from knapspec_dist.speculation.knapspec import Decision, KnapsackSelector
from knapspec_dist.speculation.schedule import ScheduleClock
from knapspec_dist.speculation.selfspec import Plan

log = logging.getLogger(__name__)

NONE = -1  # a value the decision does not have (no schedule, no DP yet, no round timed)
MICROS = 1_000_000  # the last DP's seconds, broadcast in microseconds
NANOS = 1_000_000_000  # the round's seconds, broadcast in nanoseconds
HEADER = 5  # gamma, next selection, last DP's seconds, the round's draft and verify seconds


def spmd_strategy(strategy, model: Transformer):
    """Make a strategy safe to run SPMD on every rank of a TP group: a DP selector gets its
    decisions broadcast from rank 0 (one tiny broadcast per round). A static selector's plan
    is the same on every rank already."""
    tp = getattr(model, "tp", None)
    selector = getattr(strategy, "selector", None)
    if tp is None or tp.layout.world == 1 or not isinstance(selector, KnapsackSelector):
        return strategy
    strategy.selector = SyncedSelector(selector, tp.comm)
    return strategy


def encode(decision: Decision, timing: RoundTiming | None, num_items: int) -> torch.Tensor:
    """``decision`` and the last round's seconds as one int64 vector: ``HEADER`` values, then
    one flag per sublayer skipped."""
    code = torch.full((HEADER + num_items,), NONE, dtype=torch.int64)
    code[HEADER:] = 0
    code[0] = decision.plan.gamma
    clock = decision.clock
    if clock is not None:
        code[1] = int(clock.next_selection)
        if clock.last_select_s is not None:
            code[2] = int(clock.last_select_s * MICROS)
    if timing is not None:
        code[3], code[4] = round(timing.draft_s * NANOS), round(timing.verify_s * NANOS)
    if decision.plan.skip:
        code[HEADER + torch.tensor(sorted(decision.plan.skip), dtype=torch.int64)] = 1
    return code


def decode(code: torch.Tensor, timing: RoundTiming | None
           ) -> tuple[Decision, RoundTiming | None]:
    """The decision ``encode`` wrote, and ``timing`` with the seconds it carried (None where
    this rank has none or the sender had none)."""
    plan = Plan(frozenset(torch.nonzero(code[HEADER:]).flatten().tolist()), int(code[0]))
    clock = None
    if int(code[1]) != NONE:
        last = int(code[2])
        clock = ScheduleClock(int(code[1]), None if last == NONE else last / MICROS)
    if timing is not None and int(code[3]) >= 0:
        timing = replace(timing, draft_s=int(code[3]) / NANOS, verify_s=int(code[4]) / NANOS)
    else:
        timing = None
    return Decision(plan, clock), timing


class SyncedSelector:
    """Wraps a DP selector: every rank decides (its DP issues the same collectives
    everywhere), then rank 0's ``Decision`` -- its plan and the wall-clock state of its
    schedule (speculation/schedule.py ``ScheduleClock``: the next selection, set from the
    measured selection time, and the last DP's seconds, which decide whether a DP is worth
    running) -- is broadcast and adopted by every rank, so all ranks draft with the same
    subnet and gamma and run the DP at the same steps. The last round's seconds ride on the
    same broadcast: every rank's calibration (speculation/calibration.py) is fed rank 0's, one
    round later, so all price the next selection alike; only rank 0's reports its refits
    (logs and saves the online profile: one file, not one per rank)."""

    def __init__(self, inner: KnapsackSelector, comm: Comm):
        self.inner, self.comm = inner, comm
        self.divergences = 0
        self.pending: RoundTiming | None = None  # this rank's last round, not yet fed

    def timed(self, timing: RoundTiming) -> None:
        self.pending = timing

    def __getattr__(self, name):  # selections, fallbacks, history, ...
        return getattr(self.inner, name)

    def start(self, model):
        return self.inner.start(model)

    def wants_reference(self):
        return self.inner.wants_reference()

    def observe(self, hidden, valid, rids):
        return self.inner.observe(hidden, valid, rids)

    def retire(self, rid):
        return self.inner.retire(rid)

    def record(self, drafts, verified, accepted):
        return self.inner.record(drafts, verified, accepted)

    def plan(self, model, batch):
        mine = self.inner.decide(model, batch)
        code = encode(mine, self.pending, model.cfg.num_items).to(self.comm.device)
        self.comm.broadcast(code, src=0)
        agreed, timing = decode(code.cpu(), self.pending)
        self.inner.adopt(agreed)  # every rank, rank 0 too: all hold the broadcast's values
        if timing is not None:
            self.inner.timed(timing, report=self.comm.rank == 0)
        self.pending = None
        if agreed.plan != mine.plan:
            self.divergences += 1
            log.warning("rank %d: selector plan %s differs from rank 0's %s; using rank 0's",
                        self.comm.rank, mine.plan, agreed.plan)
        return agreed.plan
