"""Progress of a job pass: a log line every few seconds (rows, tokens/s, ETA), and a tqdm bar
when stderr is a terminal.

Under continuous batching rows finish together, late, so rows done say little until the end.
Tokens are counted as they are generated instead (``live``: the replicas' count of tokens
emitted by every row, finished or not). The ETA counts decoding steps: a row is expected to
generate ``per_row`` tokens (the mean of the finished rows once there are some,
``max_new_tokens`` before); the rows in flight (``slots`` of them, the replicas' batch) need
what they have left, and the rows still queued follow in waves of ``slots``, each as long as
one row, at the rate one row has decoded so far (the token rate over the rows decoding
together). Without ``slots`` it is the tokens left over the token rate. Until every row of
the first wave has its first token (prefill, which the token rate does not measure) the ETA
is unknown ("?"). A row still decoding is expected to need at least half of what its
``max_new_tokens`` leaves (rows that stopped early at EOS do not make the others short).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
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
    max_new_tokens: int = 128
    live: Callable[[], int | None] | None = None  # tokens emitted so far by all rows
    slots: int | None = None  # rows decoding at once over all replicas
    clock: Callable[[], float] = time.monotonic
    done: int = 0
    failed: int = 0
    finished_tokens: int = 0  # generated tokens of the rows finished in this pass
    live_tokens: int = 0
    start: float = field(default=None)
    last: float = field(default=None)

    def __post_init__(self):
        self.start = self.clock() if self.start is None else self.start
        self.last = self.start if self.last is None else self.last
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
            self.finished_tokens += outcome.result.stats.new_tokens
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(tok_s=f"{self.tokens_per_s:.1f}", failed=self.failed)
        self.tick()

    @property
    def tokens(self) -> int:
        """Tokens generated in this pass so far: the live count, never less than the finished
        rows' (the live count of a restarted replica starts again)."""
        return max(self.live_tokens, self.finished_tokens)

    @property
    def tokens_per_s(self) -> float:
        elapsed = self.clock() - self.start
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def eta(self) -> float | None:
        """Seconds left (None before any token): see the module docstring."""
        rate = self.tokens_per_s
        if rate <= 0 or self.tokens < min(self.slots or 1, self.total):
            return None
        ok = self.done - self.failed
        per_row = self.finished_tokens / ok if ok else self.max_new_tokens
        generated = max(0, self.tokens - self.finished_tokens)  # by the unfinished rows
        rows_left = self.total - self.done
        if not self.slots:
            return max(0.0, rows_left * per_row - generated) / rate
        flying = min(self.slots, rows_left)
        if not flying:
            return 0.0
        row_rate = rate / min(self.slots, self.total)  # one decoding row's tokens per second
        waves = -(-(rows_left - flying) // self.slots)
        done_each = generated / flying
        # A row still decoding has outlived the early finishers: expect at least half of what
        # its budget leaves, not the finished rows' mean (which early EOS rows pull down).
        ahead = max(per_row - done_each, (self.max_new_tokens - done_each) / 2, 0.0)
        steps = ahead + waves * per_row
        return steps / row_rate

    def tick(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self.last < self.every:
            return
        self.last = now
        if self.live is not None:
            count = self.live()
            if count is not None:
                self.live_tokens = count
        eta = self.eta()
        log.info("%s: %d/%d rows (%d failed), %d tokens, %.1f tok/s, elapsed %s, ETA %s",
                 self.label, self.done, self.total, self.failed, self.tokens, self.tokens_per_s,
                 _hms(now - self.start), _hms(eta) if eta is not None else "?")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.tick(force=True)


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")
