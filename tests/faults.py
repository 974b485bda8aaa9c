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


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
