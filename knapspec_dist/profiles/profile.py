"""Typed latency profile: fitted sublayer costs for one device, model shape, dtype, batch and
TP degree.

The profile is the only source of the knapsack weights and of the TPT search's latency model,
so it keeps its raw samples next to the fitted coefficients: a stored profile can be refitted
and audited. Measuring is done elsewhere; this module only fits, queries and (de)serializes.

Every cost is refused when negative (the knapsack weights and the TPT model assume times
>= 0): ``mlp`` and the attention cost at the measured contexts must be > 0, ``head``,
``allreduce``, every raw sample and every verify fit over the measured contexts >= 0.

``samples["spread"]`` (when the profiler recorded it) holds, per measured point, the
relative spread ``(max - min) / median`` of its repeated timings; :meth:`LatencyProfile.spread`
is the median of it over the points, what profiles/store.py checks before caching a profile.

Conventions: all times are seconds. ``attention`` and ``mlp`` are the cost of one sublayer as
run by the engine, including its all-reduce when tp > 1 (so a skipped sublayer saves it);
``allreduce`` is that all-reduce alone, kept for reporting and never added a second time.
"""

from __future__ import annotations

import bisect
import datetime
import functools
import json
import logging
import math
import os
import re
import statistics
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")
MODES = ("eager", "graph")  # how the measured forwards ran: eager PyTorch or CUDA graphs
KV_LAYOUTS = ("fixed", "paged")  # the KV cache the measured forwards read: slots or pages
ORIGINS = ("measured", "online", "borrowed")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass
class LinearFit:
    """seconds = slope * n + intercept."""

    slope: float
    intercept: float

    def __call__(self, n: float) -> float:
        return self.slope * n + self.intercept


@dataclass
class LatencyProfile:
    """Fitted latency model of one (device, model shape, dtype, batch, tp) combination."""

    device: dict[str, Any]  # e.g. {"name": ..., "kind": "cpu"|"cuda", "threads": ...}
    model: dict[str, Any]  # shape: layers, hidden, heads, kv_heads, head_dim, intermediate, vocab
    dtype: str
    batch: int
    tp: int
    torch_version: str
    created: str  # ISO date
    samples: dict[str, Any]  # raw measurements, see fit_profile
    attention: LinearFit  # t_attn(n) = c2*n + c3 per sublayer, all-reduce included when tp > 1
    mlp: float  # t_mlp = c1, all-reduce included when tp > 1
    head: float  # final norm + lm_head
    verify: dict[int, LinearFit]  # q -> t_verify(q, n), fit over n
    allreduce: float = 0.0  # seconds per sublayer all-reduce at decode shape (0 when tp == 1)
    mode: str = "eager"  # execution mode of the measured forwards: "eager" or "graph"
    origin: str = "measured"  # "measured" (profiler.py), "online" (refitted from timed
    # rounds, speculation/calibration.py; its raw rounds in samples["online"]) or "borrowed"
    # (another device's, the starting point of this one's calibration: profiles/store.py; its
    # source in samples["borrowed"])
    kv: str = "fixed"  # the KV cache measured: "fixed" slots or "paged" (model/paged_cache.py,
    # whose attention gathers each row's pages once per forward)

    def spread(self) -> float | None:
        """How much the repeated timings of the measured points disagreed: the median over
        the points (attention, mlp and head per context, verify per (q, context)) of each
        point's relative spread ``(max - min) / median`` of its repeats; None when the
        profile does not record it (made by hand, or measured before it was recorded)."""
        recorded = self.samples.get("spread")
        if not recorded:
            return None
        values = [row[-1] for rows in recorded.values() for row in rows]
        return float(statistics.median(values)) if values else None

    @property
    def max_context(self) -> int:
        """The longest context length measured (beyond it attention is extrapolated)."""
        return int(max(n for n, _ in self.samples["attention"]))

    def attention_time(self, n: int) -> float:
        """One attention sublayer at context length n; never below the fastest attention
        measured (a line fitted to noisy samples, e.g. on a busy machine, can fall to zero or
        below where it is extrapolated, and a sublayer is never free)."""
        return max(self.attention(n), self._fastest_attention)

    @functools.cached_property
    def _fastest_attention(self) -> float:
        return min(s for _, s in self.samples["attention"])

    def mlp_time(self) -> float:
        """One MLP sublayer (independent of context length)."""
        return self.mlp

    def verify_time(self, q: int, n: int) -> float:
        """Full-model forward over q tokens at context n; q is interpolated between measured
        query lengths and clipped to their range (no extrapolation beyond what was measured)."""
        qs = sorted(self.verify)
        if not qs:
            raise ValueError("profile has no verify measurements")
        if q <= qs[0]:
            return self.verify[qs[0]](n)
        if q >= qs[-1]:
            return self.verify[qs[-1]](n)
        hi = bisect.bisect_left(qs, q)
        q0, q1 = qs[hi - 1], qs[hi]
        if q1 == q:
            return self.verify[q](n)
        t0, t1 = self.verify[q0](n), self.verify[q1](n)
        return t0 + (t1 - t0) * (q - q0) / (q1 - q0)

    def draft_time(self, skipped: Collection[int], n: int, num_layers: int) -> float:
        """One draft step: every executed sublayer (item 2l attention, 2l+1 mlp) plus the head."""
        attn, mlp = self.attention_time(n), self.mlp_time()
        total = self.head
        for item in range(2 * num_layers):
            if item not in skipped:
                total += attn if item % 2 == 0 else mlp
        return total

    def key(self) -> str:
        """Deterministic, file-name-safe key: device name (and a CPU's kernel build), model
        shape, dtype, batch, tp, mode (and ``__paged`` for a paged KV
        cache's)."""
        shape = "-".join(f"{k}{self.model.get(k, 'x')}" for k in MODEL_KEYS)
        name = self.device.get("name", "unknown")
        if self.device.get("kernels"):
            name += f" {self.device['kernels']}"
        raw = (f"{name}__{shape}__{self.dtype}__b{self.batch}"
               f"__tp{self.tp}__{self.mode}{'__paged' if self.kv == 'paged' else ''}")
        return re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-").lower()

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able dict (verify keys become strings, as JSON requires)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "device": self.device,
            "model": self.model,
            "dtype": self.dtype,
            "batch": self.batch,
            "tp": self.tp,
            "torch_version": self.torch_version,
            "created": self.created,
            "attention": {"slope": self.attention.slope, "intercept": self.attention.intercept},
            "mlp": self.mlp,
            "head": self.head,
            "verify": {str(q): {"slope": f.slope, "intercept": f.intercept}
                       for q, f in sorted(self.verify.items())},
            "allreduce": self.allreduce,
            "mode": self.mode,
            "origin": self.origin,
            "kv": self.kv,
            "samples": self.samples,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LatencyProfile:
        """Inverse of to_json, checked completely: a malformed profile raises ValueError with
        what is wrong (never AttributeError / TypeError, never NaN that surfaces mid-run).
        Refuses unknown schema versions; a profile without ``mode`` was measured eagerly, one
        without ``kv`` over fixed slots."""
        return _parse(d)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (temp file + rename) so concurrent readers never see a partial file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, 0o644)  # mkstemp makes 0600; a profile is a shared, readable artifact
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=2, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        logger.info("saved latency profile %s to %s", self.key(), path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LatencyProfile:
        with open(path) as f:
            return cls.from_json(json.load(f))


def _obj(key: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{key!r} must be an object, got {json.dumps(value)}")
    return value


def _number(key: str, value: Any, positive: bool = False, cost: bool = False) -> float:
    """positive: > 0; cost: a time, >= 0 (a negative cost is as wrong as a zero mlp)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key!r} must be a finite number, got {json.dumps(value)}")
    if positive and value <= 0:
        raise ValueError(f"{key!r} must be > 0, got {value}")
    if cost and value < 0:
        raise ValueError(f"{key!r} is a cost and must be >= 0, got {value}")
    return float(value)


def _rows(key: str, value: Any, width: int) -> list:
    """A list of ``width``-long rows of numbers, the last one a cost (seconds)."""
    if not isinstance(value, list) or not all(isinstance(r, list) and len(r) == width
                                              for r in value):
        raise ValueError(f"{key!r} must be a list of {width}-number rows")
    for row in value:
        for x in row[:-1]:
            _number(f"{key} key", x)
        _number(f"{key} seconds", row[-1], cost=True)
    return value


def _integer(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key!r} must be an integer >= 1, got {json.dumps(value)}")
    return value


def _fit(key: str, value: Any) -> LinearFit:
    value = _obj(key, value)
    return LinearFit(_number(f"{key}.slope", value.get("slope")),
                     _number(f"{key}.intercept", value.get("intercept")))


def _check_samples(samples: dict) -> list:
    """Every raw sample well-formed, every cost >= 0; the attention samples [[n, seconds]]."""
    attention_samples = samples.get("attention")
    if (not isinstance(attention_samples, list) or not attention_samples
            or not all(isinstance(row, list) and len(row) == 2 for row in attention_samples)):
        raise ValueError("'samples.attention' must be a non-empty list of [n, seconds]")
    for n, t in attention_samples:
        _number("samples.attention n", n, positive=True)
        _number("samples.attention seconds", t, cost=True)
    for key in ("mlp", "head"):
        if key in samples:
            if not isinstance(samples[key], list):
                raise ValueError(f"'samples.{key}' must be a list of seconds")
            for t in samples[key]:
                _number(f"samples.{key}", t, cost=True)
    for key, width in (("verify", 3), ("allreduce", 2)):
        if key in samples:
            _rows(f"samples.{key}", samples[key], width)
    if "spread" in samples:
        spread = _obj("samples.spread", samples["spread"])
        for key, value in spread.items():
            _rows(f"samples.spread.{key}", value, 3 if key == "verify" else 2)
    return attention_samples


def _check_fits(profile: LatencyProfile, verify: dict, attention_samples: list) -> None:
    """The fitted times are >= 0 over the measured contexts (a fitted slope alone may be
    negative from noise)."""
    # A fit is linear: checking both ends of the measured contexts checks every one between.
    lo, hi = int(min(n for n, _ in attention_samples)), profile.max_context
    if min(profile.attention(lo), profile.attention(hi)) <= 0:  # the fit, not the floor
        raise ValueError(f"'attention' gives a time <= 0 at the measured contexts "
                         f"(n = {lo} .. {hi}: slope {profile.attention.slope}, intercept "
                         f"{profile.attention.intercept})")
    for q, f in verify.items():
        if min(f(lo), f(hi)) < 0:
            raise ValueError(f"'verify.{q}' gives a negative time at the measured contexts "
                             f"(n = {lo} .. {hi}: slope {f.slope}, intercept {f.intercept})")


def _parse(d: Any) -> LatencyProfile:
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, got {type(d).__name__}")
    version = d.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ValueError(f"unsupported latency profile schema_version {version!r}")
    missing = [k for k in ("device", "model", "dtype", "batch", "tp", "torch_version", "created",
                           "samples", "attention", "mlp", "head", "verify") if k not in d]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")

    model = _obj("model", d["model"])
    for k in MODEL_KEYS:  # absent keys never match a model's shape (profiles/store.py)
        if k in model:
            _integer(f"model.{k}", model[k])
    verify_raw = _obj("verify", d["verify"])
    if not verify_raw:
        raise ValueError("'verify' is empty")
    verify = {}
    for q, f in verify_raw.items():
        if not str(q).isdigit() or int(q) < 1:
            raise ValueError(f"'verify' keys must be query lengths >= 1, got {q!r}")
        verify[int(q)] = _fit(f"verify.{q}", f)
    samples = _obj("samples", d["samples"])
    attention_samples = _check_samples(samples)
    mode = d.get("mode", "eager")
    if mode not in MODES:
        raise ValueError(f"'mode' must be one of {', '.join(MODES)}, got {json.dumps(mode)}")
    origin = d.get("origin", "measured")
    if origin not in ORIGINS:
        raise ValueError(f"'origin' must be one of {', '.join(ORIGINS)}, got {json.dumps(origin)}")
    kv = d.get("kv", "fixed")
    if kv not in KV_LAYOUTS:
        raise ValueError(f"'kv' must be one of {', '.join(KV_LAYOUTS)}, got {json.dumps(kv)}")
    for key in ("dtype", "torch_version", "created"):
        if not isinstance(d[key], str):
            raise ValueError(f"{key!r} must be a string, got {json.dumps(d[key])}")
    profile = LatencyProfile(
        device=dict(_obj("device", d["device"])),
        model=dict(model),
        dtype=d["dtype"],
        batch=_integer("batch", d["batch"]),
        tp=_integer("tp", d["tp"]),
        torch_version=d["torch_version"],
        created=d["created"],
        samples=dict(samples),
        attention=_fit("attention", d["attention"]),
        mlp=_number("mlp", d["mlp"], positive=True),
        head=_number("head", d["head"], cost=True),
        verify=verify,
        allreduce=_number("allreduce", d.get("allreduce", 0.0), cost=True),
        mode=mode,
        origin=origin,
        kv=kv,
    )
    _check_fits(profile, verify, attention_samples)
    return profile


def fit_linear(points: list[tuple[float, float]]) -> LinearFit:
    """Ordinary least squares y = slope * x + intercept.

    One point (or one distinct x) gives slope 0.
    """
    if not points:
        raise ValueError("cannot fit a line to no points")
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    mx, my = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if sxx == 0.0:
        return LinearFit(0.0, my)
    slope = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return LinearFit(slope, my - slope * mx)


def fit_profile(samples: dict[str, Any], **meta: Any) -> LatencyProfile:
    """Fit every coefficient from raw samples.

    samples: {"attention": [[n, s], ...], "mlp": [s, ...], "head": [s, ...],
              "verify": [[q, n, s], ...], "allreduce": [[bytes, s], ...] (optional)}.
    meta: device, model, dtype, batch, tp, torch_version, created (defaults to today), mode
    (defaults to "eager"), kv (defaults to "fixed").
    Constant costs (mlp, head) use the median, robust to the odd slow repeat.
    """
    required = ("device", "model", "dtype", "batch", "tp", "torch_version")
    missing = [k for k in required if k not in meta]
    if missing:
        raise ValueError(f"fit_profile needs meta {missing}")
    clean = _normalize_samples(samples)
    by_q: dict[int, list[tuple[float, float]]] = {}
    for q, n, s in clean["verify"]:
        by_q.setdefault(int(q), []).append((n, s))
    tp, batch, dtype = int(meta["tp"]), int(meta["batch"]), str(meta["dtype"])
    allreduce = 0.0
    if tp > 1 and clean.get("allreduce"):
        decode_bytes = batch * int(meta["model"]["hidden"]) * DTYPE_BYTES.get(dtype, 4)
        allreduce = max(0.0, fit_linear([(b, s) for b, s in clean["allreduce"]])(decode_bytes))
    return LatencyProfile(
        device=dict(meta["device"]),
        model=dict(meta["model"]),
        dtype=dtype,
        batch=batch,
        tp=tp,
        torch_version=str(meta["torch_version"]),
        created=str(meta.get("created") or datetime.date.today().isoformat()),
        samples=clean,
        attention=fit_linear([(n, s) for n, s in clean["attention"]]),
        mlp=statistics.median(clean["mlp"]),
        head=statistics.median(clean["head"]),
        verify={q: fit_linear(pts) for q, pts in sorted(by_q.items())},
        allreduce=allreduce,
        mode=str(meta.get("mode", "eager")),
        kv=str(meta.get("kv", "fixed")),
    )


def _normalize_samples(samples: dict[str, Any]) -> dict[str, Any]:
    """Lists of lists of floats, exactly what JSON gives back, so save/load round-trips equal."""
    for k in ("attention", "mlp", "head", "verify"):
        if not samples.get(k):
            raise ValueError(f"samples[{k!r}] is missing or empty")
    out: dict[str, Any] = {k: [float(s) for s in samples[k]] for k in ("mlp", "head")}
    for k in ("attention", "verify", "allreduce"):
        if k in samples:
            out[k] = [[float(v) for v in row] for row in samples[k]]
    if samples.get("spread"):
        out["spread"] = {k: [[float(v) for v in row] for row in rows]
                         for k, rows in samples["spread"].items()}
    return out


def integer_weights(profile: LatencyProfile, n: int, num_layers: int,
                    cap: float = 5.0) -> list[int]:
    """Knapsack weights at context n, in item order (attention, mlp, attention, mlp, ...).

    delta = min(t_attn(n), t_mlp); each weight is its time over delta, capped at `cap` and
    rounded half up (not Python's banker's rounding), at least 1.
    """
    t_attn, t_mlp = profile.attention_time(n), profile.mlp_time()
    delta = min(t_attn, t_mlp)
    if delta <= 0.0:
        raise ValueError(f"sublayer times must be positive, got attention {t_attn}, mlp {t_mlp}")

    def weight(t: float) -> int:
        return max(1, math.floor(min(t / delta, cap) + 0.5))

    return [weight(t_attn), weight(t_mlp)] * num_layers
