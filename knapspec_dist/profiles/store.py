"""Find the latency profile that matches a model on this device, or measure one.

Profiles live as JSON under ``profiles/`` (override with ``KNAPSPEC_PROFILES``), keyed by device,
model shape, dtype, batch and TP degree. A missing profile is measured, never guessed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..errors import UserError
from .profile import LatencyProfile

log = logging.getLogger(__name__)


def profiles_dir() -> Path:
    env = os.environ.get("KNAPSPEC_PROFILES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "profiles"


def matches(profile: LatencyProfile, device: dict, shape: dict, dtype: str, batch: int,
            tp: int) -> bool:
    return (profile.device.get("name") == device.get("name")
            and profile.device.get("threads") == device.get("threads")
            and all(profile.model.get(k) == v for k, v in shape.items())
            and profile.dtype == dtype and profile.batch == batch and profile.tp == tp)


def find_profile(directory: Path, device: dict, shape: dict, dtype: str, batch: int = 1,
                 tp: int = 1) -> LatencyProfile | None:
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob("*.json")):
        try:
            profile = LatencyProfile.load(path)
        except (ValueError, KeyError, OSError) as e:
            log.warning("skipping unreadable profile %s: %s", path, e)
            continue
        if matches(profile, device, shape, dtype, batch, tp):
            log.info("using latency profile %s", path)
            return profile
    return None


def resolve_profile(spec, model, tp: int = 1, batch: int = 1) -> LatencyProfile:
    """``spec``: a LatencyProfile, a JSON path, or None (find a matching one, else measure)."""
    if isinstance(spec, LatencyProfile):
        return spec
    if spec:
        try:
            return LatencyProfile.load(spec)
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"cannot load latency profile {spec!r}: {e}") from None
    from . import profiler
    from .device import device_info, dtype_name

    device = device_info(model.device)
    dtype = dtype_name(model.dtype)
    found = find_profile(profiles_dir(), device, model.cfg.shape(), dtype, batch, tp)
    if found is not None:
        return found
    log.warning("no latency profile in %s matches device %r, model %s, %s, batch %d, tp %d: "
                "measuring one now (run `knapspec profile` once to keep it)",
                profiles_dir(), device.get("name"), model.cfg.shape(), dtype, batch, tp)
    return profiler.measure(model, contexts=profiler.QUICK_CONTEXTS, batch=batch)
