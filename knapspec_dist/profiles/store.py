"""Where latency profiles live, how one is chosen for a model on a device, and where a
measured one is kept.

Lookup order: the repository's ``profiles/`` (override with ``KNAPSPEC_PROFILES``), then the
profile cache ``<cache dir>/profiles`` (``KNAPSPEC_PROFILE_CACHE``, else under
``KNAPSPEC_CACHE`` / ``~/.cache/knapspec_dist``). Profiles are keyed by device, model shape,
dtype, batch, TP degree, execution mode and KV layout (fixed slots, or pages: ``kv``). A
profile is used when it matches all of them and
its measured contexts reach the longest context the run needs (when that is known); when none
does, one is measured (never guessed) and kept in the cache, so the next job, and the other
replicas of a cluster sharing the cache, load it instead of measuring again.

A run whose prices online calibration refits (speculation/calibration.py) need not wait for that
measurement: with ``borrow``, when nothing of this device matches, it starts from a
``starting_point`` instead (origin "borrowed"): this device's last online refit of the
same model, else another device's profile of the same model (same kind of device, dtype,
batch, tp and mode), relabelled as this device's with the source kept in
``samples["borrowed"]``. The calibration fits its prices to this machine from the run's
own timed rounds and keeps each refit, raw rounds included, in ``online/``. On a CPU that
no shipped profile names, the first run then starts in seconds instead of measuring for
minutes.

A measured profile is kept only when it was measured on a quiet machine: the median over
its measured points of each point's relative spread ``(max - min) / median`` of the repeats
(``LatencyProfile.spread``) must be at most ``SPREAD_LIMIT`` = 0.25, and on a CPU the load
beside the measurement, from the 1-minute load average the profiler recorded before and after,
must be small (``device.cpu_busy``, the profiler's own busy-machine warning).
``KNAPSPEC_PROFILE_MAX_SPREAD`` overrides the spread limit (``inf``: keep every measured
profile, both checks off). A profile that fails either prices the run that measured it,
with a WARNING, and is not cached, so it never prices a later job.

``--profile PATH`` names one file; it is checked completely when loaded and refused (one
error line) when it is malformed or was measured for another model shape.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from knapspec_dist.cache import cache_dir
from knapspec_dist.errors import UserError
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.model.weights import dtype_name
from knapspec_dist.profiles import profiler
from knapspec_dist.profiles.device import cpu_busy, device_info
from knapspec_dist.profiles.profile import MODEL_KEYS, LatencyProfile

log = logging.getLogger(__name__)

#: The largest ``LatencyProfile.spread`` (median over the measured points of the repeats'
#: ``(max - min) / median``) of a profile that is cached: above it the machine was busy.
#: Repeats on the idle 2-core Intel Xeon agree within a few percent; on a 2-core CPU shared
#: with a load average of 5.5 they differed by 0.2 (median) and up to 0.7 of their median.
#: On an idle 2-core AMD EPYC VM they spread 0.29-0.56 (a bare 2048^2 matmul 0.09-0.65), so
#: no profile measured there is cached: the shipped ones in ``profiles/`` price it.
SPREAD_LIMIT = 0.25

#: Context lengths a measurement covers, up to the longest the run needs (that one included).
CONTEXT_STEPS = (64, 256, 1024, 4096, 16384, 65536)


@dataclass
class ProfileChoice:
    """The profile that prices a run, where it came from, and the stored profiles at other
    batch sizes beside it (what prices a batched round, profiles/batching.py)."""

    profile: LatencyProfile
    path: str | None  # the file it was loaded from, or where a measured one was kept
    origin: str  # "loaded" (a stored file or the one named), "measured" (now) or
    # "borrowed" (a starting point that online calibration fits: ``starting_point``)
    siblings: list[LatencyProfile] = field(default_factory=list)

    @property
    def profiles(self) -> list[LatencyProfile]:
        return [self.profile, *self.siblings]

    def describe(self) -> dict:
        return {"key": self.profile.key(), "path": self.path, "origin": self.origin}


def profiles_dir() -> Path:
    env = os.environ.get("KNAPSPEC_PROFILES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "profiles"


def cache_profiles_dir() -> Path:
    env = os.environ.get("KNAPSPEC_PROFILE_CACHE")
    return Path(env) if env else cache_dir() / "profiles"


def search_dirs() -> list[Path]:
    return [profiles_dir(), cache_profiles_dir()]


def shape_mismatch(profile: LatencyProfile, shape: dict) -> list[str]:
    """``"layers: 4 (profile) vs 30 (model)"`` for every shape key that differs."""
    return [f"{k}: {profile.model.get(k)} (profile) vs {shape.get(k)} (model)"
            for k in sorted(set(MODEL_KEYS) | set(shape))
            if k in shape and profile.model.get(k) != shape.get(k)]


def load_profile(path, shape: dict | None = None) -> LatencyProfile:
    """``--profile PATH``: read and check it completely; with ``shape``, refuse a profile
    measured for another model shape. Every problem is one UserError."""
    try:
        profile = LatencyProfile.load(path)
    except OSError as e:
        raise UserError(f"cannot load latency profile {str(path)!r}: {e.strerror or e}") from None
    except ValueError as e:
        raise UserError(f"latency profile {str(path)!r} is malformed: {e}") from None
    if shape is not None:
        differ = shape_mismatch(profile, shape)
        if differ:
            raise UserError(f"latency profile {str(path)!r} was measured for another model shape "
                            f"({'; '.join(differ)}); measure one for this model with "
                            "`knapspec profile`, or omit --profile")
    return profile


def matches(profile: LatencyProfile, device: dict, shape: dict, dtype: str, batch: int,
            tp: int, mode: str = "eager", kv: str = "fixed") -> bool:
    return (profile.device.get("name") == device.get("name")
            and profile.device.get("threads") == device.get("threads")
            and same_vector_unit(profile.device, device)
            and not shape_mismatch(profile, shape)
            and profile.dtype == dtype and profile.batch == batch and profile.tp == tp
            and profile.mode == mode and profile.kv == kv)


def same_vector_unit(measured: dict, device: dict) -> bool:
    """Whether a CPU profile's vector unit and kernel build are the device's, where both say
    (a profile that does not record one matches on its name alone)."""
    return all(measured.get(k) is None or device.get(k) is None or measured[k] == device[k]
               for k in ("isa", "kernels"))


def find_profile(directories: Sequence[Path], device: dict, shape: dict, dtype: str,
                 batch: int = 1, tp: int = 1, mode: str = "eager",
                 need: int | None = None, kv: str = "fixed") -> ProfileChoice | None:
    """The first matching profile in ``directories`` whose measured contexts reach ``need``;
    None when there is none."""
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.json")):
            try:
                profile = LatencyProfile.load(path)
            except (ValueError, OSError) as e:
                log.warning("skipping unreadable profile %s: %s", path, e)
                continue
            if not matches(profile, device, shape, dtype, batch, tp, mode, kv):
                continue
            if need is not None and profile.max_context < need:
                log.info("profile %s covers contexts up to %d, this run needs %d: not used",
                         path, profile.max_context, need)
                continue
            log.info("using latency profile %s", path)
            return ProfileChoice(profile, str(path), "loaded")
    return None


def batch_siblings(profile: LatencyProfile) -> list[LatencyProfile]:
    """Stored profiles of the same device, shape, dtype, tp, mode and KV layout at other
    batch sizes (one per size, the first found): what prices a batched round
    (profiles/batching.py)."""
    found: dict[int, LatencyProfile] = {}
    for directory in search_dirs():
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.json")):
            try:
                other = LatencyProfile.load(path)
            except (ValueError, OSError):
                continue
            if other.batch != profile.batch and other.batch not in found and matches(
                    other, profile.device, profile.model, profile.dtype, other.batch,
                    profile.tp, profile.mode, profile.kv):
                found[other.batch] = other
    return [found[b] for b in sorted(found)]


def spread_limit() -> float:
    """``SPREAD_LIMIT``, or ``KNAPSPEC_PROFILE_MAX_SPREAD`` when set (``inf``: keep every
    measured profile)."""
    env = os.environ.get("KNAPSPEC_PROFILE_MAX_SPREAD")
    if not env:
        return SPREAD_LIMIT
    try:
        return float(env)
    except ValueError:
        raise UserError(f"KNAPSPEC_PROFILE_MAX_SPREAD={env!r} is not a number") from None


def unsteady(profile: LatencyProfile) -> str | None:
    """Why the profile was measured on a busy machine, or None: its repeats' spread is above
    ``spread_limit()``, or (a CPU) the load beside it was high (``device.cpu_busy``). What a
    profile does not record counts as quiet."""
    limit = spread_limit()
    if limit == float("inf"):
        return None
    spread = profile.spread()
    if spread is not None and spread > limit:
        return (f"its repeated timings disagree (relative spread {spread:.2f}, median over the "
                f"points, > {limit:.2f})")
    return cpu_busy(profile.device)


def steady(profile: LatencyProfile) -> bool:
    """Whether the profile was measured on a quiet machine (:func:`unsteady`)."""
    return unsteady(profile) is None


def keep(profile: LatencyProfile) -> str | None:
    """Save a measured profile in the cache (atomically); its path, or None when it is not
    kept: its repeats disagree (the machine was busy; a WARNING says so, and the profile
    still prices this run), or the cache cannot be written (a read-only cache only costs a
    measurement next time)."""
    path = cache_profiles_dir() / f"{profile.key()}.json"
    busy = unsteady(profile)
    if busy:
        log.warning("the latency profile measured now is used for this run but not kept in %s: "
                    "%s, so the machine was busy. Measure again on an idle machine "
                    "(`knapspec profile`) for later runs", path.parent, busy)
        return None
    return _save(profile, path, "measured")


def _save(profile: LatencyProfile, path: Path, what: str) -> str | None:
    """Save atomically; the path, or None (with a WARNING) where it cannot be written."""
    try:
        profile.save(path)
    except OSError as e:
        log.warning("could not keep the %s profile in %s: %s", what, path, e)
        return None
    return str(path)


def online_profiles_dir() -> Path:
    """Where profiles refitted online (speculation/calibration.py) are kept.

    That is the cache's ``online/`` directory.
    """
    return cache_profiles_dir() / "online"


def keep_online(profile: LatencyProfile) -> str | None:
    """Save a profile refitted from a run's timed rounds (origin "online", its raw rounds in
    its samples) in ``online_profiles_dir()``: beside the measured files, never over one and
    never under ``profiles/``. The lookup does not read it (a refit from one run's rounds
    must not silently price another's workload); ``--profile PATH`` can. Its path, or None
    where it cannot be written."""
    path = online_profiles_dir() / f"{profile.key()}.json"
    if path.resolve().is_relative_to(profiles_dir().resolve()):
        log.warning("not saving the online profile to %s: it is under the measured profiles "
                    "(%s)", path, profiles_dir())
        return None
    return _save(profile, path, "online")


def decode_mode(device: dict) -> str:
    """The execution mode decoding runs in on ``device`` (``device_info``): CUDA graphs on a
    GPU, eager ops on a CPU; the profile that prices it must be measured the same way."""
    return "graph" if device.get("kind") == "cuda" else "eager"



#: Contexts measured when the run's longest context is unknown. The widest of the two sets
#: the local and the Ray path used before (256..4096, not 64..1024): the attention slope is
#: fitted over a longer span, and the kept profile serves every later run up to 4096 tokens
#: instead of being refused (and measured again) by any that needs more than 1024.
DEFAULT_CONTEXTS = (256, 1024, 4096)

#: How a resolver measures when nothing stored fits: ``measure(contexts, mode)``.
Measure = Callable[[list[int], str], LatencyProfile]


def contexts_for(need: int | None, window: int | None = None) -> list[int]:
    """Context lengths to measure: ``DEFAULT_CONTEXTS`` when the run's longest context is
    unknown, else the steps below ``need`` and ``need`` itself; none past the model's
    ``window``."""
    if need is None:
        return sorted({c if window is None else min(c, window) for c in DEFAULT_CONTEXTS})
    if window is not None:
        need = min(need, window)
    return sorted({c for c in CONTEXT_STEPS if c < need} | {need})


def lookup(path: str | None, devices: Sequence[dict], shape: dict, dtype: str, *,
           tp: int = 1, need: int | None = None, borrow: bool = False,
           kv: str = "fixed") -> ProfileChoice | None:
    """The profile that prices a run on ``devices`` (``device_info`` of every rank) without
    measuring: the file ``path`` names (used alone), else the first stored one that matches
    and covers ``need`` (with its batch siblings), else with ``borrow`` a ``starting_point``;
    None (with a WARNING saying so) when one must be measured. Ranks on different devices
    never match a stored profile. ``kv``: the KV layout the run decodes over ("fixed",
    "paged"), which the profile must have been measured over; with ``borrow``, this device's
    profile over the other layout is the next best starting point (calibration refits it)."""
    if path:
        return ProfileChoice(load_profile(path, shape), str(path), "loaded")
    device, mode = devices[0], decode_mode(devices[0])
    names = sorted({d.get("name") for d in devices})
    if len(names) > 1:
        log.warning("ranks run on different devices %s; no stored profile applies, measuring "
                    "one (priced at the slowest rank)", names)
        return None
    found = find_profile(search_dirs(), device, shape, dtype, 1, tp, mode, need, kv)
    if found is not None:
        found.siblings = batch_siblings(found.profile)
        return found
    other = "fixed" if kv == "paged" else "paged"
    if borrow and (found := find_profile(search_dirs(), device, shape, dtype, 1, tp, mode, need,
                                         other)) is not None:
        log.warning("no latency profile of this device was measured over a %s KV cache: "
                    "starting from %s, measured over %s, which online calibration refits "
                    "from the run's own timed rounds", kv, found.path, other)
        why, path = f"measured over {other} KV", Path(found.path)
        return ProfileChoice(borrowed(found.profile, device, path, why, kv), found.path,
                             "borrowed", [borrowed(s, device, path, why, kv)
                                          for s in batch_siblings(found.profile)])
    what = (f"device {device.get('name')!r}, model {shape}, {dtype}, batch 1, tp {tp}, {mode}"
            f"{f', contexts up to {need}' if need else ''}")
    where = " or ".join(map(str, search_dirs()))
    if borrow:
        found = starting_point(device, shape, dtype, tp, mode, need, kv)
        if found is not None:
            log.warning("no latency profile in %s matches %s: starting from %s (%s), which "
                        "online calibration refits to this machine from the run's own timed "
                        "rounds (refits kept in %s); `knapspec profile` measures one for this "
                        "machine", where, what, found.path, found.profile.samples["borrowed"]
                        ["why"], online_profiles_dir())
            return found
    log.warning("no latency profile in %s matches %s: measuring one now (kept in %s for later "
                "runs if its repeats agree)", where, what, cache_profiles_dir())
    return None


def adopt(profile: LatencyProfile) -> ProfileChoice:
    """A profile measured now: kept in the cache (``keep``), with the stored batch siblings."""
    return ProfileChoice(profile, keep(profile), "measured", batch_siblings(profile))


def resolve(path: str | None, devices: Sequence[dict], shape: dict, dtype: str, *,
            measure: Measure, tp: int = 1, need: int | None = None, window: int | None = None,
            contexts: Sequence[int] | None = None, borrow: bool = False,
            kv: str = "fixed") -> ProfileChoice:
    """``lookup`` (over the KV layout ``kv``), else one measured now by ``measure`` (at
    ``contexts``, default ``contexts_for(need, window)``, over that layout) and ``adopt``-ed."""
    found = lookup(path, devices, shape, dtype, tp=tp, need=need, borrow=borrow, kv=kv)
    if found is None:
        found = adopt(measure(list(contexts or contexts_for(need, window)),
                              decode_mode(devices[0])))
    return found


def _profiles_in(directories: Sequence[Path]) -> list[tuple[Path, LatencyProfile]]:
    """Every readable profile in ``directories``, in lookup order."""
    out = []
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.json")):
            try:
                out.append((path, LatencyProfile.load(path)))
            except (ValueError, OSError):
                continue
    return out


def starting_point(device: dict, shape: dict, dtype: str, tp: int = 1, mode: str = "eager",
                   need: int | None = None, kv: str = "fixed") -> ProfileChoice | None:
    """What prices a run that online calibration refits when no profile of ``device``
    matches: this device's last online refit of the model over ``kv`` at batch 1
    (``online_profiles_dir()``), else another device's profile of the same model, kind of
    device, dtype, batch 1, tp and mode (preferring one that covers ``need``, then one over
    ``kv``, then the same CPU model, then the same thread count), with that device's stored
    batch siblings. Relabelled as ``device``'s over ``kv`` (``borrowed``); None when there is
    none."""
    for path, profile in _profiles_in([online_profiles_dir()]):
        if matches(profile, device, shape, dtype, 1, tp, mode, kv):
            return ProfileChoice(borrowed(profile, device, path, "this machine's online refit "
                                          "of an earlier run", kv), str(path), "borrowed")
    kind = device.get("kind")
    candidates = [(path, p) for path, p in _profiles_in(search_dirs())
                  if p.device.get("kind") == kind and p.origin == "measured"
                  and matches(p, p.device, shape, dtype, 1, tp, mode, p.kv)]
    if not candidates:
        return None

    def rank(item: tuple[Path, LatencyProfile]) -> tuple:
        p = item[1]
        return (need is not None and p.max_context < need, p.kv != kv,
                p.device.get("cpu_model") != device.get("cpu_model"),
                p.device.get("threads") != device.get("threads"))

    path, source = min(candidates, key=rank)  # min is stable: the first in lookup order
    why = f"measured on {source.device.get('name')!r}"
    siblings = [borrowed(s, device, path, why, kv) for s in batch_siblings(source)]
    return ProfileChoice(borrowed(source, device, path, why, kv), str(path), "borrowed",
                         siblings)


def borrowed(profile: LatencyProfile, device: dict, path: Path, why: str,
             kv: str | None = None) -> LatencyProfile:
    """``profile`` as the starting point of ``device``'s calibration over the ``kv`` layout
    the run decodes over (default: the profile's): keyed by both (so its online refits are
    kept as this device's, over that layout), origin "borrowed", and where it came from in
    ``samples["borrowed"]`` (source device, key and file; kept through refits)."""
    source = profile.samples.get("borrowed") or {"device": profile.device, "key": profile.key(),
                                                 "path": str(path)}
    out = replace(profile, device=dict(device), origin="borrowed", kv=kv or profile.kv)
    out.samples = {**profile.samples, "borrowed": {**source, "why": why}}
    return out


def resolve_for_model(path: str | None, model: Transformer,
                      need: int | None = None, kv: str = "fixed") -> ProfileChoice:
    """``resolve`` for ``model`` in this process (one rank, measured here when needed), over
    the KV layout ``kv`` its runs decode over."""
    def measure(contexts: list[int], mode: str) -> LatencyProfile:
        return profiler.measure(model, contexts=contexts, batch=1, mode=mode, kv=kv)

    return resolve(path, [device_info(model.device)], model.cfg.shape(), dtype_name(model.dtype),
                   measure=measure, need=need, window=model.cfg.max_position_embeddings, kv=kv)


def resolve_profile(path: str | None, model: Transformer) -> LatencyProfile:
    """The profile alone (callers that price one batch size)."""
    return resolve_for_model(path, model).profile
