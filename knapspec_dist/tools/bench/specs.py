"""``--strategies``: a comma-separated list of strategy specs (``spec.options.parse_strategy``:
``knapspec:paper+coupled``, ``static:a3,m5@4``, ``clasp@4``)."""

from __future__ import annotations

import logging
import re

from knapspec_dist.errors import UserError
from knapspec_dist.speculation.options import NamedStrategy, parse_strategy

log = logging.getLogger(__name__)

__all__ = ["NamedStrategy", "parse_strategies", "parse_strategy"]


def parse_strategies(text: str) -> list[NamedStrategy]:
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
