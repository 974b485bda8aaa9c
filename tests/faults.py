"""Faults injected from outside the engine: shard actor classes that fail on purpose.

A test puts one in place of runtime/replica.py's ``Shard`` (``monkeypatch.setattr``), whose
actors the engine then starts; these subclasses of the real
:class:`~knapspec_dist.runtime.shard.Shard` fail where a crashed process would. They are
pickled by value, so Ray's workers need not import this test folder.
"""

from __future__ import annotations

import os
import sys
import time

import ray.cloudpickle

from knapspec_dist.runtime.shard import Shard


class RankOneDiesAtSetup(Shard):
    """Rank 1 exits while loading its shard, as a crashed process would."""

    def setup(self, *args, **kwargs) -> dict:
        if self.rank == 1:
            os._exit(1)
        return super().setup(*args, **kwargs)


def slow_measure(delay_s: float) -> type[Shard]:
    """A rank class whose profile measurement first waits ``delay_s`` (a slow machine's
    minutes of measuring)."""

    class SlowMeasure(Shard):
        def measure_profile(self, *args, **kwargs) -> dict:
            time.sleep(delay_s)
            return super().measure_profile(*args, **kwargs)

    return SlowMeasure


def dies_once_busy(flag: str) -> type[Shard]:
    """A rank class whose process exits the first time a call leaves rows in flight (pages
    held), while no file ``flag`` exists (it writes it first: the restarted rank lives)."""

    class DiesOnceBusy(Shard):
        def advance(self, *args, **kwargs):
            out = super().advance(*args, **kwargs)
            if out.busy and not os.path.exists(flag):
                open(flag, "w").close()
                os._exit(1)
            return out

    return DiesOnceBusy


#: Bytes free beside the weights on each rank of ``UnevenMemory`` (rank 1 has less).
FREE = {0: 240_000, 1: 140_000}
#: A row whose prompt starts with this token fails every round it takes part in.
FAIL_TOKEN = 1


class UnevenMemory(Shard):
    """Rank 1 has less memory free than rank 0 (``FREE``); and a round over a row whose
    prompt starts with ``FAIL_TOKEN`` raises on every rank alike, before its first
    collective (a bug mid-round, with the rows holding their pages)."""

    def free_memory(self) -> int:
        return FREE[self.rank]

    def configure(self, *args, **kwargs) -> None:
        super().configure(*args, **kwargs)
        real = self.strategy.round

        def failing_round(model, batch, *rest):
            if any(row.prompt[0] == FAIL_TOKEN for row in batch.rows):
                raise RuntimeError("injected fault mid-round")
            return real(model, batch, *rest)

        self.strategy.round = failing_round


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
