"""Strategy specs of ``--strategies``: ``knapspec:coupled+once``, ``static:a3,m5@4``, ``clasp@4``."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

from knapspec_dist.errors import UserError
from knapspec_dist.spec.options import NAMES, StrategyOptions

log = logging.getLogger(__name__)

FLAGS = {"coupled": {"coupled": True}, "alpha": {"objective": "alpha"},
         "once": {"select_once": True}, "tpt": {"objective": "tpt"}}

@dataclass(frozen=True)
class StrategySpec:
    label: str  # as shown in tables and plots, canonical form of the spec
    options: StrategyOptions


def parse_strategy(text: str) -> StrategySpec:
    """One spec (``knapspec:coupled+once``, ``static:a3,m5@4``, ``clasp@4``) -> StrategySpec."""
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
        if not parts:
            raise UserError(f"strategy {text!r}: static needs a skip list, e.g. static:a3,m5@4")
        options = replace(options, skip=",".join(parts))
    if name in ("knapspec", "clasp"):
        for flag in parts:
            if flag not in FLAGS:
                raise UserError(f"strategy {text!r}: unknown flag {flag!r}; choose from "
                                f"{', '.join(FLAGS)}")
            options = replace(options, **FLAGS[flag])
    label = name + (":" + "+".join(parts) if parts else "") + (f"@{gamma}" if gamma else "")
    if name == "static":
        label = f"static:{','.join(parts)}" + (f"@{gamma}" if gamma else "")
    return StrategySpec(label, options)


def parse_strategies(text: str) -> list[StrategySpec]:
    """Comma-separated specs; the commas inside a static skip list belong to it."""
    merged: list[str] = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        if (merged and merged[-1].startswith("static:") and "@" not in merged[-1]
                and re.fullmatch(r"[am]\d+(@\d+)?", tok)):
            merged[-1] += "," + tok
        else:
            merged.append(tok)
    specs = [parse_strategy(t) for t in merged]
    labels = [s.label for s in specs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise UserError(f"--strategies lists {', '.join(dupes)} more than once")
    if "ar" not in labels:
        log.info("adding ar, the reference every strategy is checked against")
        specs.insert(0, parse_strategy("ar"))
    return specs
