"""What a strategy is asked to be: its name and options, checked before any work starts."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from knapspec_dist.engine.sequence import MAX_GAMMA
from knapspec_dist.errors import UserError
from knapspec_dist.profiles.store import load_profile

NAMES = ("ar", "static", "knapspec", "clasp")
FLAGS = {"coupled": {"coupled": True}, "alpha": {"objective": "alpha"},
         "once": {"select_once": True}, "tpt": {"objective": "tpt"}, "paper": {"paper": True},
         "calibrate": {"calibrate": True}, "fixed": {"calibrate": False},
         "copy": {"drafts": "copy"}, "subnet": {"drafts": "subnet"}}
KNAPSPEC_ONLY = ("paper", "calibrate", "fixed", "copy", "subnet")
DRAFTS = ("both", "copy", "subnet")  # knapspec's draft sources: copied (lookup.py), subnets
PAPER_MIN_INTERVAL = 7  # m = 5 gathered rounds (2..6) and the DP's round


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
    paper: bool = False  # knapspec: the authors' selection (speculation/paper.py)
    # knapspec: refit prices from the run's timed rounds (speculation/calibration.py); None: on for
    # the default, off for :paper (flags ``calibrate`` / ``fixed``)
    calibrate: bool | None = None
    # knapspec: where drafts come from, each round priced by TPT: "both" (the default),
    # "copy" (copied from the row's own tokens only, no DP) or "subnet" (subnets only)
    drafts: str = "both"


def parse_skip(text: str, num_layers: int) -> frozenset[int]:
    """``a3,a5,m7`` -> knapsack items {6, 10, 15} (attention of layer l is 2l, its MLP 2l+1)."""
    items = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"([am])(\d+)", part)
        if not m:
            raise UserError(f"invalid skip entry {part!r}: expected a<layer> or m<layer>, "
                            "e.g. a3,m7")
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
    if options.calibrate is not None and options.name != "knapspec":
        raise UserError(f"calibration is a knapspec option, not one of {options.name}")
    if options.paper and options.name != "knapspec":
        raise UserError("'paper' is a knapspec variant (knapspec:paper), not one of "
                        f"{options.name}")
    if options.drafts not in DRAFTS:
        raise UserError(f"drafts must be one of {', '.join(DRAFTS)}, got {options.drafts!r}")
    if options.drafts != "both" and options.name != "knapspec":
        raise UserError(f"'{options.drafts}' is a knapspec option, not one of {options.name}")
    if options.paper and options.drafts == "copy":
        raise UserError("knapspec:paper drafts from subnets only; 'copy' does not apply")
    if options.paper and options.interval < PAPER_MIN_INTERVAL:
        raise UserError(f"knapspec:paper re-selects every interval rounds, gathering rounds 2-6 "
                        f"of each: the interval must be >= {PAPER_MIN_INTERVAL}, got "
                        f"{options.interval}")
    parse_skip(options.skip, cfg.num_layers)
    if options.profile:
        load_profile(options.profile, cfg.shape())  # malformed or another shape: refused now


@dataclass(frozen=True)
class NamedStrategy:
    label: str  # as shown in tables and plots, canonical form of the spec
    options: StrategyOptions


def parse_strategy(text: str, skip: str = "") -> NamedStrategy:
    """One strategy as the user names it (``knapspec:paper+coupled``, ``static:a3,m5@4``,
    ``clasp@4``) -> NamedStrategy: the one parser of strategy names (generate, job, bench).
    ``skip``: a static skip list given apart from the name (``--strategy static --skip a3``)."""
    spec = text.strip()
    gamma = None
    m = re.fullmatch(r"(.*)@(\d+)", spec)
    if m:
        spec, gamma = m.group(1), int(m.group(2))
    name, colon, rest = spec.partition(":")
    if name not in NAMES:
        raise UserError(f"strategy {text!r}: unknown name {name!r}; choose one of "
                        f"{', '.join(NAMES)} (with :flags or @gamma)")
    if colon and not rest:
        raise UserError(f"strategy {text!r}: nothing after ':'")
    if gamma is not None and name not in ("static", "clasp"):
        raise UserError(f"strategy {text!r}: @gamma applies to static and clasp only")
    options = StrategyOptions(name=name)
    if gamma is not None:
        options = replace(options, gamma=gamma)
    parts = [p.strip() for p in re.split(r"[+,]", rest) if p.strip()]
    if name == "ar" and parts:
        raise UserError(f"strategy {text!r}: ar takes no options")
    if name == "static":
        if not parts and not skip:
            raise UserError(f"strategy {text!r}: static needs a skip list, e.g. static:a3,m5@4")
        options = replace(options, skip=",".join(parts) or skip)
    if name in ("knapspec", "clasp"):
        for flag in parts:
            if flag not in FLAGS or (flag in KNAPSPEC_ONLY and name != "knapspec"):
                allowed = [f for f in FLAGS if name == "knapspec" or f not in KNAPSPEC_ONLY]
                raise UserError(f"strategy {text!r}: unknown flag {flag!r}; choose from "
                                f"{', '.join(allowed)}")
            options = replace(options, **FLAGS[flag])
    label = name + (":" + "+".join(parts) if parts else "") + (f"@{gamma}" if gamma else "")
    if name == "static":
        label = f"static:{','.join(parts)}" + (f"@{gamma}" if gamma else "")
    return NamedStrategy(label, options)
