"""Time budget of the check: every section gets a share of the total, and a section whose
share is spent stops between two rows (its later rows are skipped and say so, and the
section's record says it was cut), so the command finishes in its budget on any machine
instead of being killed half-written.

The clock is the wall clock from the start of the process (imports and the SmolLM2
conversion are paid from the budget too), so compiles and graph captures are paid from the
section they happen in, and a section that compiled longer leaves less to the later ones. A
measurement known to start with a compile or capture asks for that much time left
(``over(need_s)``, its caller's estimate from the last first call), instead of starting at
the end of a share. A long measurement made of steps (a continuous-batching run) calls
``check()`` between them, which raises ``Spent`` once the share is gone: that row is cut
there, not finished past the share."""

from __future__ import annotations

import time

import psutil

# Shares of the total per section, in the order the command runs them: plain forwards of the
# shapes first (the least code), then the strategies, and the riskiest parts last (the other
# attention backend, per-sublayer draft graphs), so that a crash there, which may poison the
# CUDA context, costs nothing measured before it. Measurements within a section go smallest
# first: what is skipped is the largest part.
SHARES = {"shapes": 0.24, "correctness": 0.14, "bf16": 0.06, "bench": 0.10, "batched": 0.10,
          "findings": 0.08, "paged": 0.08, "backends": 0.08, "drafting": 0.04, "pieces": 0.08}


def process_start() -> float:
    """When this process started, on ``time.monotonic``'s scale (its imports are paid from the
    budget as well); now where the system does not say."""
    try:
        age = time.time() - psutil.Process().create_time()
    except (psutil.Error, OSError):
        age = 0.0
    return time.monotonic() - max(0.0, age)


class Spent(Exception):
    """A section's share ran out in the middle of a measurement (``Section.check``)."""


class Budget:
    def __init__(self, total_s: float, clock=time.monotonic, started: float | None = None):
        """``started``: when the time began, on ``clock`` (the process start); else now."""
        self.total_s, self.clock = total_s, clock
        self.start = clock() if started is None else started
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
    def __init__(self, name: str, end: float, seconds: float, clock,
                 parent: "Section | None" = None):
        self.name, self.end, self.seconds, self.clock = name, end, seconds, clock
        self.parent = parent
        self.cut: str | None = None  # why rows were skipped or cut for time, once they were

    def left(self) -> float:
        return self.end - self.clock()

    def over(self, need_s: float = 0.0) -> str | None:
        """None while more than ``need_s`` seconds are left; else the note a skipped
        measurement records (and the section is marked cut)."""
        left = self.left()
        if left > max(need_s, 0.0):
            return None
        if left > 0:
            why = (f"skipped: {self.name} has {left:.0f} s left, its first call (compile and "
                   f"capture) took {need_s:.0f} s")
        else:
            why = f"skipped: {self.name} time budget ({self.seconds:.0f} s) spent"
        self.mark_cut(why)
        return why

    def check(self) -> None:
        """Raise ``Spent`` when nothing is left: called between the steps of a measurement."""
        if self.left() <= 0:
            why = f"cut: {self.name} time budget ({self.seconds:.0f} s) spent mid-measurement"
            self.mark_cut(why)
            raise Spent(why)

    def mark_cut(self, why: str) -> None:
        section = self
        while section is not None:
            section.cut = section.cut or why
            section = section.parent

    def part(self, name: str, fraction: float) -> "Section":
        """A sub-budget: ``fraction`` of what is left of this one (a cut in it cuts this)."""
        seconds = max(0.0, self.left()) * fraction
        return Section(f"{self.name}/{name}", min(self.clock() + seconds, self.end), seconds,
                       self.clock, self)
