"""What a strategy is asked to be: its name and options, checked before any work starts."""

from __future__ import annotations

import re
from dataclasses import dataclass

from knapspec_dist.engine.sequence import MAX_GAMMA
from knapspec_dist.errors import UserError
from knapspec_dist.profiles.store import load_profile

NAMES = ("ar", "static", "knapspec", "clasp")


@dataclass(frozen=True)
class StrategyOptions:
    name: str = "ar"
    skip: str = ""  # static: sublayers like "a3,a5,m7"
    gamma: int = 4  # static and clasp draft length
    tau_conf: float = 0.7
    profile: str | None = None  # knapspec / clasp: latency profile JSON (None: measure one)
    interval: int = 64
    coupled: bool = False
    objective: str = "tpt"
    select_once: bool = False


def parse_skip(text: str, num_layers: int) -> frozenset[int]:
    """``a3,a5,m7`` -> knapsack items {6, 10, 15} (attention of layer l is 2l, its MLP 2l+1)."""
    items = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"([am])(\d+)", part)
        if not m:
            raise UserError(f"invalid skip entry {part!r}: expected a<layer> or m<layer>, e.g. a3,m7")
        layer = int(m.group(2))
        if layer >= num_layers:
            raise UserError(f"skip entry {part!r}: the model has layers 0..{num_layers - 1}")
        items.add(2 * layer + (m.group(1) == "m"))
    return frozenset(items)


def format_skip(items: frozenset[int]) -> str:
    return ",".join(f"{'am'[i % 2]}{i // 2}" for i in sorted(items))


def check_options(options: StrategyOptions, cfg) -> None:
    """Every check of the options that needs no weights (``cfg``: the model's ModelConfig):
    the one place the CLI, the engine and the jobs have them checked, before any work."""
    if options.name not in NAMES:
        raise UserError(f"unknown strategy {options.name!r}; choose one of {', '.join(NAMES)}")
    if not 1 <= options.gamma <= MAX_GAMMA:
        raise UserError(f"gamma must be in 1..{MAX_GAMMA}, got {options.gamma}")
    if not 0 <= options.tau_conf <= 1:
        raise UserError(f"tau_conf must be in [0, 1], got {options.tau_conf}")
    if options.interval < 1:
        raise UserError(f"interval must be >= 1, got {options.interval}")
    parse_skip(options.skip, cfg.num_layers)
    if options.profile:
        load_profile(options.profile, cfg.shape())  # malformed or another shape: refused now
