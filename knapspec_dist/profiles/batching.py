"""Latency at any batch size, from profiles measured at a few.

A batched round is priced at the batch it runs: on a GPU a decode step costs about the same at
batch 1 and 32 (weights dominate) while KV reads grow with the batch; on a CPU the step is
compute-bound and grows with it. Profiles are measured per batch size (``knapspec profile
--batch B``); between two measured sizes every fitted coefficient is interpolated linearly.
Outside the measured range the nearest measured size is used, and said once per process
in the log at INFO (never extrapolated silently; it is a fact about the stored profiles, not
a fault of the job, and every shard and round would otherwise repeat it).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import replace

from knapspec_dist.profiles.profile import LatencyProfile, LinearFit

log = logging.getLogger(__name__)

#: measured batch sets already noted in this process: one note per profile, not per batch.
_NOTED: set[tuple[int, ...]] = set()


def _mix(a: float, b: float, w: float) -> float:
    return a + (b - a) * w


def _mix_fit(a: LinearFit, b: LinearFit, w: float) -> LinearFit:
    return LinearFit(_mix(a.slope, b.slope, w), _mix(a.intercept, b.intercept, w))


def interpolate(lo: LatencyProfile, hi: LatencyProfile, batch: int) -> LatencyProfile:
    """The profile at ``batch`` between ``lo.batch`` and ``hi.batch`` (coefficients linear in
    the batch size; verify lengths measured in both)."""
    w = (batch - lo.batch) / (hi.batch - lo.batch)
    verify = {q: _mix_fit(lo.verify[q], hi.verify[q], w) for q in lo.verify if q in hi.verify}
    return replace(lo, batch=batch, attention=_mix_fit(lo.attention, hi.attention, w),
                   mlp=_mix(lo.mlp, hi.mlp, w), head=_mix(lo.head, hi.head, w), verify=verify,
                   allreduce=_mix(lo.allreduce, hi.allreduce, w))


class BatchPricing:
    """Profiles of one device / model / dtype / tp / mode at several batch sizes."""

    def __init__(self, profiles: LatencyProfile | Sequence[LatencyProfile]):
        if isinstance(profiles, LatencyProfile):
            profiles = [profiles]
        by_batch = {p.batch: p for p in profiles}
        if not by_batch:
            raise ValueError("no latency profile to price with")
        self.batches = sorted(by_batch)
        self.profiles = [by_batch[b] for b in self.batches]
        self._cache: dict[int, LatencyProfile] = {}

    @property
    def base(self) -> LatencyProfile:
        return self.profiles[0]

    def at(self, batch: int) -> LatencyProfile:
        """The profile that prices a round of ``batch`` rows."""
        found = self._cache.get(batch)
        if found is not None:
            return found
        i = bisect.bisect_left(self.batches, batch)
        if i < len(self.batches) and self.batches[i] == batch:
            found = self.profiles[i]
        elif 0 < i < len(self.batches):
            found = interpolate(self.profiles[i - 1], self.profiles[i], batch)
        else:
            found = self.profiles[0 if i == 0 else -1]
            note = tuple(self.batches)
            if note not in _NOTED:
                _NOTED.add(note)
                log.info("no latency profile at batch %d (measured: %s); pricing it as "
                         "batch %d, and other unmeasured batches as the nearest measured one. "
                         "Measure one with `knapspec profile --batch %d`", batch,
                         self.batches, found.batch, batch)
        self._cache[batch] = found
        return found
