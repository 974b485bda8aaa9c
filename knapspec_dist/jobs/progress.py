"""Progress of a job pass: a log line every few seconds (rows, tokens/s, ETA), and a tqdm bar
when stderr is a terminal."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from knapspec_dist.jobs.dispatch import Outcome

log = logging.getLogger("knapspec_dist.jobs.runner")  # the job's progress lines, as before


@dataclass
class Progress:
    """A log line every ``every`` seconds (rows done, tokens/s, ETA) and an optional tqdm bar."""

    total: int
    every: float
    label: str
    bar_enabled: bool | None = None
    done: int = 0
    failed: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.bar = None
        enabled = sys.stderr.isatty() if self.bar_enabled is None else self.bar_enabled
        if enabled and self.total:
            self.bar = tqdm(total=self.total, desc=self.label, unit="row", file=sys.stderr,
                            dynamic_ncols=True)

    def update(self, outcome: Outcome) -> None:
        self.done += 1
        if outcome.error is not None:
            self.failed += 1
        elif outcome.result is not None:
            self.tokens += outcome.result.stats.new_tokens
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(tok_s=f"{self.tokens_per_s:.1f}", failed=self.failed)
        self.tick()

    @property
    def tokens_per_s(self) -> float:
        elapsed = time.monotonic() - self.start
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.start
        left = self.total - self.done
        eta = elapsed / self.done * left if self.done else None
        log.info("%s: %d/%d rows (%d failed), %.1f tok/s, elapsed %s, ETA %s", self.label,
                 self.done, self.total, self.failed, self.tokens_per_s, _hms(elapsed),
                 _hms(eta) if eta is not None else "?")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.tick(force=True)


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")
