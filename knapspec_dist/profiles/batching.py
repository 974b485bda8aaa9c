"""Latency at any batch size, from profiles measured at a few.

A batched round is priced at the batch it runs: on a GPU a decode step costs about the same at
batch 1 and 32 (weights dominate) while KV reads grow with the batch, until the batch's tokens
make the forward compute-bound (a verify of 5 tokens at 256 rows: 1280 tokens a forward), where
its cost grows with the tokens and speculation pays less; on a CPU the step is compute-bound
and grows with it. Profiles are measured per batch size (``knapspec profile --batch B``);
between two measured sizes every fitted coefficient is interpolated linearly.

Below the smallest measured size, the smallest is used. Beyond the largest, the line through
the two largest is continued (each coefficient at least the largest's: a bigger batch never
costs less), so the per-row cost the measured batches show keeps growing, and a verify whose
cost grows with its tokens per row more at the larger batch keeps doing so; with one profile
there is nothing to extrapolate from and it is used flat. Either way a WARNING says so, once
per process and set of measured sizes: beyond the measured batches the prices are a guess that
only measuring (``knapspec profile --batch B``) or online calibration
(speculation/calibration.py, which refits each batch size from its own timed rounds) replaces.
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


def extrapolate(lo: LatencyProfile, hi: LatencyProfile, batch: int) -> LatencyProfile:
    """The profile at ``batch`` > ``hi.batch``: the line through ``lo`` and ``hi`` continued,
    every coefficient floored at ``hi``'s (noise that made ``hi`` cheaper than ``lo`` must not
    make a larger batch cheaper still)."""
    w = (batch - lo.batch) / (hi.batch - lo.batch)

    def fit(a: LinearFit, b: LinearFit) -> LinearFit:
        return LinearFit(max(b.slope, _mix(a.slope, b.slope, w)),
                         max(b.intercept, _mix(a.intercept, b.intercept, w)))

    verify = {q: fit(lo.verify[q], hi.verify[q]) for q in hi.verify if q in lo.verify}
    return replace(hi, batch=batch, attention=fit(lo.attention, hi.attention),
                   mlp=max(hi.mlp, _mix(lo.mlp, hi.mlp, w)),
                   head=max(hi.head, _mix(lo.head, hi.head, w)),
                   verify=verify or hi.verify,
                   allreduce=max(hi.allreduce, _mix(lo.allreduce, hi.allreduce, w)))


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
        elif i == 0 or len(self.batches) == 1:
            found = self.profiles[0 if i == 0 else -1]
            self._note(batch, f"pricing it as batch {found.batch}, the nearest measured")
        else:
            found = extrapolate(self.profiles[-2], self.profiles[-1], batch)
            self._note(batch, f"extrapolating from batches {self.batches[-2]} and "
                              f"{self.batches[-1]}")
        self._cache[batch] = found
        return found

    def _note(self, batch: int, how: str) -> None:
        """The WARNING that a batch outside the measured ones is priced by a guess (once per
        process and set of measured batches: every shard and round would repeat it)."""
        note = tuple(self.batches)
        if note not in _NOTED:
            _NOTED.add(note)
            log.warning("no latency profile at batch %d (measured: %s): %s, and so for other "
                        "batches outside the measured ones. Measure one with `knapspec "
                        "profile --batch %d`", batch, self.batches, how, batch)
