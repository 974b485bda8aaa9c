"""Time budget of the check: every section gets a share of the total, and a measurement that
would start after its section's share (or the whole budget) is spent is skipped and said so,
so the command finishes in its budget on any machine instead of being killed half-written."""

from __future__ import annotations

import time

# Shares of the total per section, in the order the command runs them. Measurements within
# a section go smallest first, so what is skipped is the largest, least essential part.
SHARES = {"shapes": 0.45, "correctness": 0.17, "bench": 0.2, "batched": 0.18}


class Budget:
    def __init__(self, total_s: float, clock=time.monotonic):
        self.total_s, self.clock = total_s, clock
        self.start = clock()
        self.deadline = self.start + total_s

    def elapsed(self) -> float:
        return self.clock() - self.start

    def section(self, name: str) -> "Section":
        """The section's share of the time left, against the sections still to come (time an
        earlier section did not use goes to the later ones)."""
        names = list(SHARES)
        later = sum(SHARES[n] for n in names[names.index(name):])
        left = max(0.0, self.deadline - self.clock())
        seconds = left * SHARES[name] / later
        return Section(name, self.clock() + seconds, seconds, self.clock)


class Section:
    def __init__(self, name: str, end: float, seconds: float, clock):
        self.name, self.end, self.seconds, self.clock = name, end, seconds, clock

    def left(self) -> float:
        return self.end - self.clock()

    def over(self) -> str | None:
        """None while there is time; else the note a skipped measurement records."""
        if self.left() > 0:
            return None
        return f"skipped: {self.name} time budget ({self.seconds:.0f} s) spent"

    def part(self, name: str, fraction: float) -> "Section":
        """A sub-budget: ``fraction`` of what is left of this one."""
        seconds = max(0.0, self.left()) * fraction
        return Section(f"{self.name}/{name}", min(self.clock() + seconds, self.end), seconds,
                       self.clock)
