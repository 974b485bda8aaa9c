"""The one ratio of the project's figures (tokens per second, acceptance, mean batch, shares),
and how a figure without data is shown.

A ratio over no data (a zero, negative or missing denominator, or a missing numerator) is
None, shown as null in the outputs and summaries: a 0.0 would read like a measurement.
"""

from __future__ import annotations


def ratio(part: float | None, whole: float | None) -> float | None:
    """``part / whole``, or None where there is no data to divide."""
    if part is None or whole is None or whole <= 0:
        return None
    return part / whole


def shown(value: float | None, spec: str, none: str = "-") -> str:
    """A figure in a report or log line: ``none`` where it has no data."""
    return none if value is None else format(value, spec)
