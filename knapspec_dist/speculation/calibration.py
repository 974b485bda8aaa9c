"""Online self-calibration: refit what Tokens-per-Time prices from the engine's own timed rounds.

Why: a latency profile measured offline drifts with batch, KV layout, load and hardware (the
paper names it as its limitation and suggests "lightweight online self-calibration"), and the
rounds the engine times anyway are measurements of the same costs.

Each decoding round is one raw sample (``RoundTiming``): batch size, mean context, the skip set,
its draft forwards and their seconds, and the verify forward's seconds, timed by the round's own
clock marks (speculation/selfspec.py: CUDA events read after the round's one read-back on a GPU,
``perf_counter`` on a CPU; no host sync is added). The model refitted is the profile's own,
scaled:

    draft forward (S, n) = kA * attention(n) * attentions run + kM * mlp * MLPs run + kH * head
    verify (q, n)        = kV[q] * verify(q, n)

and a round's seconds are its draft forwards plus its verify, priced one way only: through the
scaled profile (``scaled``, ``round_seconds``), for the drift test, the comparison of two fits
and the next selection alike. A plain round (q = 1) is also a full forward (nothing skipped,
scaled to the profile's verify(1, n)), so plain decoding alone separates attention from MLP
wherever the context varies (attention grows with n, MLP does not). The sublayer factors are a
Huber regression on relative residuals with a weak prior toward the samples' common ratio: what
the samples cannot tell apart stays priced in the profile's proportions. kV[q] (a context part
and a rest) is the same fit over q's samples where there are ``SUSTAIN`` of them, else over
every q's. Factors are fitted per batch size with enough samples (the batch-size dependence),
else pooled.

Drift: a round off its prediction by more than the profile's band (its stated noise,
``LatencyProfile.spread``, at least ``MIN_BAND`` and at most ``MAX_BAND``: a spread past the
limit a profile is cached at is the load's while it was measured, and would hide a 2x drift)
for ``SUSTAIN`` rounds in a row starts a new regime; the factors are refitted from the rounds
since that run began, and refreshed every ``REFRESH`` rounds of the regime. Every refit prices
the next selection (``price``). A refit is reported (logged at INFO and saved, with its raw
samples and origin "online", to the profile cache: profiles/store.py ``keep_online``) only
when it is news: it is a refresh (its regime has lasted ``REFRESH`` rounds, so a burst of load
that ends sooner is never reported), it departs from the last refit reported (first: the
stored profile) by more than the band, and ``REPORT_EVERY`` rounds have passed since the last
report, or it departs by more than ``LARGE`` bands. Under TP only rank 0 reports
(``observe``'s ``report``). When the clock agrees with the profile nothing is refitted.

Acceptance per subnet is refitted from the same rounds by speculation/acceptance.py's
``AcceptanceBook``; this module prices time only. Everything here is a function of the samples,
so under TP (speculation/spmd.py) every rank, fed rank 0's seconds, prices alike.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from knapspec_dist.profiles.profile import LatencyProfile, LinearFit
from knapspec_dist.profiles.store import SPREAD_LIMIT

log = logging.getLogger(__name__)

SUSTAIN = 8  # rounds in a row off the band that make a drift
REFRESH = 64  # rounds of a regime between refreshes of its fit
WINDOW = 512  # raw samples kept per regime
MIN_BAND = 0.10  # the least relative deviation counted as drift
MAX_BAND = SPREAD_LIMIT  # the most (a wider stated spread was measured on a busy machine)
REPORT_EVERY = 256  # rounds between two reported refits at least, ...
LARGE = 2.0  # ... unless the later departs from the earlier by this many bands
MIN_BATCH_SAMPLES = SUSTAIN  # samples of one batch size it is fitted from alone
PRIOR = 1.0  # the prior spread of a sublayer factor, relative to the common ratio
HUBER = 1.345  # Huber's constant, in robust standard deviations of the residuals
IRLS_STEPS = 10  # reweightings of the Huber fit at most (it settles in a few)


@dataclass(frozen=True)
class RoundTiming:
    """One timed round: ``drafts`` draft forwards with ``skip`` skipped (0: a plain round) and
    their ``draft_s``, then one verify of ``verified`` tokens in ``verify_s``: the pending
    token, the drafts and the ``copied`` ones (drafts copied from the rows' own tokens,
    lookup.py, which cost no forward)."""

    batch: int
    context: int
    skip: frozenset[int]
    drafts: int
    draft_s: float
    verify_s: float
    copied: int = 0

    @property
    def verified(self) -> int:
        return self.drafts + self.copied + 1

    def row(self) -> list:
        """As saved with an online profile: [batch, context, drafts, draft_s, verify_s, skip,
        copied]."""
        return [self.batch, self.context, self.drafts, self.draft_s, self.verify_s,
                sorted(self.skip), self.copied]


@dataclass(frozen=True)
class Factors:
    """Measured over predicted, per cost of the profile (1: as profiled). A verify line is
    scaled in its two parts: the context-dependent one (its slope: KV reads) and the rest."""

    attention: float = 1.0
    mlp: float = 1.0
    head: float = 1.0
    verify: dict[int, tuple[float, float]] = field(default_factory=dict)  # q (0: pooled) ->
    # (slope, intercept) factors

    def verify_at(self, q: int) -> tuple[float, float]:
        return self.verify.get(q) or self.verify.get(0) or (1.0, 1.0)

    def describe(self) -> str:
        verify = ", ".join(f"{f'q{q}' if q else 'every q'} x{k[0]:.2f}/x{k[1]:.2f}"
                           for q, k in sorted(self.verify.items()))
        return (f"attention x{self.attention:.2f}, MLP x{self.mlp:.2f}, head x{self.head:.2f}, "
                f"verify (context part/rest) {verify}")


def scaled(profile: LatencyProfile, f: Factors) -> LatencyProfile:
    """The profile with every cost scaled by its factor (its offline samples unchanged): the
    one price of the refitted model (``round_seconds``). Its verify has a line at every q
    from 1 to one past the last q measured or fitted alone, each the stored line at q (as it
    interpolates) times q's factors, so a q between measured ones, or past them, is priced
    at its own factors, not its neighbours'."""
    a = profile.attention

    def line(q: int) -> LinearFit:
        v, (ks, ki) = verify_line(profile, q), f.verify_at(q)
        return LinearFit(v.slope * ks, v.intercept * ki)

    last = max(max(profile.verify), max(f.verify, default=0) + 1)
    out = replace(profile, attention=LinearFit(a.slope * f.attention, a.intercept * f.attention),
                  mlp=profile.mlp * f.mlp, head=profile.head * f.head,
                  verify={q: line(q) for q in range(1, last + 1)})
    # the floor (the fastest attention measured, ``attention_time``) scales too
    out.__dict__["_fastest_attention"] = min(
        s for _, s in profile.samples["attention"]) * f.attention
    return out


def round_seconds(profile: LatencyProfile, t: RoundTiming, num_layers: int) -> float:
    """The seconds ``profile`` prices round ``t`` at: its draft forwards, then its verify."""
    return (t.drafts * profile.draft_time(t.skip, t.context, num_layers)
            + profile.verify_time(t.verified, t.context))


def verify_line(profile: LatencyProfile, q: int) -> LinearFit:
    """The profile's verify line at q (interpolated between measured q, as it prices)."""
    lo, hi = profile.verify_time(q, 0), profile.verify_time(q, 1)
    return LinearFit(hi - lo, lo)


def sublayer_features(profile: LatencyProfile, t: RoundTiming, num_layers: int
                      ) -> tuple[list[float], float]:
    """(attention, MLP, head seconds the profile prices in one forward of ``t``, the measured
    forward): a draft forward, or for a round without one the verify in the profile's
    proportions."""
    attn, mlp = profile.attention_time(t.context), profile.mlp_time()
    if t.drafts:
        ran_a = sum(1 for i in range(0, 2 * num_layers, 2) if i not in t.skip)
        ran_m = sum(1 for i in range(1, 2 * num_layers, 2) if i not in t.skip)
        return [ran_a * attn, ran_m * mlp, profile.head], t.draft_s / t.drafts
    full = [num_layers * attn, num_layers * mlp, profile.head]
    ratio = profile.verify_time(t.verified, t.context) / sum(full)
    return [x * ratio for x in full], t.verify_s


def huber_fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Factors k minimizing Huber(y - k . x) over relative residuals (each row over its
    prediction at k = 1), with a Gaussian prior at the median ratio k0 (spread ``PRIOR`` x
    k0 per factor, weighed against the residuals' robust spread): a direction the samples
    pin down follows them, one they cannot tell apart stays at k0."""
    x = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    scale = x.sum(dim=1)
    x, y = x / scale[:, None], y / scale
    k0 = float(y.median())
    k = torch.full((x.shape[1],), k0, dtype=torch.float64)
    eye = torch.eye(x.shape[1], dtype=torch.float64)
    for _ in range(IRLS_STEPS):
        r = y - x @ k
        s = max(1.4826 * float((r - r.median()).abs().median()), 1e-4 * k0)
        w = torch.clamp(HUBER * s / r.abs().clamp(min=1e-300), max=1.0).sqrt()
        prior = s / (PRIOR * k0)  # the prior's rows, in units of the residuals' spread
        a = torch.cat([x * w[:, None], eye * prior])
        b = torch.cat([y * w, torch.full((x.shape[1],), prior * k0, dtype=torch.float64)])
        k, last = torch.linalg.lstsq(a, b[:, None]).solution[:, 0], k
        if float((k - last).abs().max()) < 1e-6 * k0:
            break
    return [min(max(float(v), 0.05 * k0), 20.0 * k0) for v in k]


Features = tuple[list[float], float, list[float]]  # sublayer seconds, step, verify parts


def features(t: RoundTiming, price: Callable[[int], LatencyProfile], num_layers: int
             ) -> Features:
    """What the stored profile prices in ``t``: its step's sublayer seconds and the measured
    step (``sublayer_features``), and its verify line's context and constant parts at t."""
    p = price(t.batch)
    xs, y = sublayer_features(p, t, num_layers)
    v = verify_line(p, t.verified)
    return xs, y, [v.slope * t.context, v.intercept]


def fit(samples: list[RoundTiming], price: Callable[[int], LatencyProfile],
        num_layers: int, memo: dict[RoundTiming, Features] | None = None) -> Factors:
    """Factors from ``samples``; ``price(batch)``: the stored profile at that batch size;
    ``memo``: their ``features`` where known (filled in). Verify: pooled over q, and per q
    with ``SUSTAIN`` samples or more."""
    memo = {} if memo is None else memo
    rows, ys, by_q = [], [], {}
    for t in samples:
        f = memo.get(t)
        if f is None:
            f = memo[t] = features(t, price, num_layers)
        rows.append(f[0])
        ys.append(f[1])
        by_q.setdefault(t.verified, []).append((f[2], t.verify_s))
    attention, mlp, head = huber_fit(rows, ys)
    verify = {0: tuple(huber_fit([x for xs in by_q.values() for x, _ in xs],
                                 [y for xs in by_q.values() for _, y in xs]))}
    for q, xs in by_q.items():
        if len(xs) >= SUSTAIN and len(by_q) > 1:
            verify[q] = tuple(huber_fit([x for x, _ in xs], [y for _, y in xs]))
    return Factors(attention, mlp, head, verify)


class Calibration:
    """The run's timed rounds, the drift test and the factors that price the next selection.
    Drift is judged per batch size: a regime (the samples since that size's last drift)
    per size, fitted together (pooled) and, with enough samples, alone."""

    def __init__(self, price: Callable[[int], LatencyProfile], num_layers: int,
                 save: Callable[[LatencyProfile], object] | None = None):
        """``price(batch)``: the stored profile at that batch size; ``save``: where a refit
        that is news goes (profiles/store.py ``keep_online``; None: nowhere)."""
        self.price, self.num_layers, self.save = price, num_layers, save
        self.refits = 0  # drift-started regimes and their refreshes, over all runs
        self.rounds = 0  # rounds observed, over all runs
        self.reported_at: int | None = None  # ``rounds`` at the last report
        self.fits: dict[int | None, Factors] = {}  # batch size (None: pooled) -> factors
        self.reported = Factors()  # the last refit reported (first: the stored profile)
        self.regimes: dict[int, deque[RoundTiming]] = {}
        self.runs: dict[int, list[RoundTiming]] = {}  # per size, its rounds off the band
        self.since_fit = 0
        self.cache: dict[int, LatencyProfile] = {}
        self.memo: dict[RoundTiming, Features] = {}  # the samples' features (``fit``)
        self.checked = False  # whether the clock has confirmed or refitted the prices

    def factors(self, batch: int) -> Factors:
        return self.fits.get(batch) or self.fits.get(None) or Factors()

    def profile(self, batch: int) -> LatencyProfile:
        """The refitted profile of a round of ``batch`` rows (the stored one until a drift)."""
        found = self.cache.get(batch)
        if found is None:
            base = self.price(batch)
            found = base if not self.fits else scaled(base, self.factors(batch))
            self.cache[batch] = found
        return found

    def band(self, batch: int) -> float:
        return min(max(self.price(batch).spread() or 0.0, MIN_BAND), MAX_BAND)

    def predicted(self, t: RoundTiming) -> float:
        """The seconds the prices in force give round ``t`` (what the drift test compares)."""
        return round_seconds(self.profile(t.batch), t, self.num_layers)

    def observe(self, t: RoundTiming, report: bool = True) -> bool:
        """One timed round; whether the prices were refitted from it. ``report``: whether a
        refit that is news is logged and saved here (TP: on rank 0 only). The prices are
        ``checked`` from the first round at which ``SUSTAIN`` rounds have been timed and no
        run of rounds off the band is pending (a drift about to refit)."""
        refitted = self._observe(t, report)
        if not self.checked and self.rounds >= SUSTAIN and not any(self.runs.values()):
            self.checked = True
            log.debug("online calibration: prices checked after %d rounds%s", self.rounds,
                      f" ({self.refits} refits)" if self.refits else "")
        return refitted

    def _observe(self, t: RoundTiming, report: bool) -> bool:
        b, band = t.batch, self.band(t.batch)
        self.rounds += 1
        off = abs((t.draft_s + t.verify_s) / self.predicted(t) - 1.0) > band
        run = self.runs[b] = self.runs.get(b, []) + [t] if off else []
        if b in self.regimes:
            self.regimes[b].append(t)
        if self.fits:
            self.since_fit += 1
        if len(run) >= SUSTAIN:
            self.regimes[b] = deque(run, maxlen=WINDOW)
            self.runs[b] = []
            self.refit(f"drift: {SUSTAIN} rounds of batch {b} in a row off the profile by "
                       f"more than {100 * band:.0f} %", settled=False, report=report)
            return True
        if self.fits and self.since_fit >= REFRESH:
            self.refit(f"refreshed from {sum(map(len, self.regimes.values()))} rounds",
                       settled=True, report=report)
            return True
        return False

    @property
    def samples(self) -> list[RoundTiming]:
        return [t for regime in self.regimes.values() for t in regime]

    def refit(self, why: str, settled: bool, report: bool = True) -> None:
        """Refit the factors from the regimes' samples; report them if news (``settled``:
        REFRESH rounds or more since the last drift)."""
        samples = self.samples
        memo = {t: self.memo[t] for t in samples if t in self.memo}
        fits: dict[int | None, Factors] = {None: fit(samples, self.price, self.num_layers, memo)}
        for batch, regime in self.regimes.items():
            if len(regime) >= MIN_BATCH_SAMPLES and len(self.regimes) > 1:
                fits[batch] = fit(list(regime), self.price, self.num_layers, memo)
        self.memo = memo
        self.fits, self.cache, self.since_fit = fits, {}, 0
        self.refits += 1
        pooled = fits[None]
        band = min(map(self.band, self.regimes))
        departs = self.departure(pooled, samples)
        due = (self.reported_at is None or self.rounds - self.reported_at >= REPORT_EVERY
               or departs > LARGE * band)
        if not (settled and departs > band and due):
            log.debug("online calibration (%s): %s, %.0f %% from the last reported (band "
                      "%.0f %%), not reported", why, pooled.describe(), 100 * departs,
                      100 * band)
            return
        self.reported, self.reported_at = pooled, self.rounds
        if not report:
            return
        log.info("online calibration (%s): %s against the stored profile", why,
                 pooled.describe())
        if self.save is not None:
            most = max(self.regimes, key=lambda b: len(self.regimes[b]))
            # batch 1 too: the next run starts from this machine's batch-1 refit (store.py
            # ``starting_point``), whatever batch this run's rounds ran at
            for batch in sorted({1, most}):
                self.save(self.online_profile(batch))

    def departure(self, f: Factors, samples: list[RoundTiming]) -> float:
        """The largest relative difference of a round's seconds between ``f`` and the last
        refit reported: two fits are compared in the rounds' time, where a cost's share
        weighs its factor."""
        profiles: dict[tuple[int, int], LatencyProfile] = {}  # (batch, id of factors) ->

        def seconds(factors: Factors, t: RoundTiming) -> float:
            key = (t.batch, id(factors))
            if key not in profiles:
                profiles[key] = scaled(self.price(t.batch), factors)
            return round_seconds(profiles[key], t, self.num_layers)

        return max(abs(seconds(f, t) / seconds(self.reported, t) - 1) for t in samples)

    def online_profile(self, batch: int) -> LatencyProfile:
        """The refitted profile at ``batch``, its raw online samples and factors kept, origin
        "online"."""
        f, base = self.factors(batch), self.price(batch)
        out = scaled(base, f)
        out.samples = {**base.samples, "online": {
            "rounds": [t.row() for t in self.regimes.get(batch, self.samples)],
            "columns": ["batch", "context", "drafts", "draft_s", "verify_s", "skip",
                        "copied"],
            "factors": {"attention": f.attention, "mlp": f.mlp, "head": f.head,
                        "verify": {str(q): list(k) for q, k in sorted(f.verify.items())}}}}
        out.origin = "online"
        return out
