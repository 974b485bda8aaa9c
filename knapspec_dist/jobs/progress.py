"""Progress of a job pass: a log line every few seconds (rows, tokens/s, ETA), and a tqdm bar
when stderr is a terminal.

Under continuous batching rows finish together, late, so rows done say little until the end.
The replicas report their ``Work`` as it happens instead (``live``): tokens emitted by every
row, finished or not, prompt tokens prefilled, and the seconds each took. The ETA is the
prefill still to do plus the decoding steps still to run, each at the rate the replicas have
measured for it (a replica prefills and decodes in turn, and the replicas run side by side):

- prefill: the pass's prompt tokens not yet prefilled, at the replicas' prefill rate;
- decoding: a row is expected to generate ``per_row`` tokens (the mean of the finished rows
  once there are some, ``max_new_tokens`` before); the rows in flight (``slots`` of them, the
  replicas' batch) need what they have left, and the rows still queued follow in waves of
  ``slots``, each as long as one row, at the rate one row decodes: its tokens per round (the
  tokens of the rounds over the rows that took part in them, ``row_rounds``: more than one
  under speculation) over the seconds of a round. Not the replicas' token rate over the
  slots: in a prefill-heavy pass rows join one by one between prefill chunks, so only a few
  decode at once until late, and that divided a row's rate by the idle slots too. A row
  still decoding is expected to need at least half of what its ``max_new_tokens`` leaves
  (rows that stopped early at EOS do not make the others short). Once rows have waited for
  KV memory, the pages, not the row cap, bound the rows in flight: the waves are then as wide
  as the most rows the pools held at once (``KVReport.peak_rows``, per replica).

The line ends with the replicas' KV cache (``memory``, runtime/messages.py's ``KVReport``):
its size, peak use, the rows in flight (mean and peak) and the seconds rows waited for memory.

Rows summarized through trees (long documents) take many generations each: then the pass
counts generations, not rows (``generations_total``: a row one, a tree its chunks and, above
them, the packing's bound, runtime/tree.py ``DocumentTree.work_bound``, replaced by what the
tree took once it ends; the rows not yet streamed at the mean of those streamed, as their
prompt tokens are). The waves above are then waves of generations, each as long as the
generations finished so far.

Both rates are the replicas' over the last ``window`` seconds (two minutes; the whole pass
until it is that long, or where the window holds no prefill or no round): a machine whose load
changes, or a pass whose rows change, is read at its pace now, not at the pass's mean, which
lags by the whole pass. Until both rates are measured the ETA is unknown ("?"). Without
``live`` (or before it answers) the token rate is the wall-clock one and prefill is not
counted. Rows that failed on their input (written, never generated: ``skipped``) count as
done and failed, as the job's report counts them.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from tqdm import tqdm

from knapspec_dist.engine.scheduler import Work
from knapspec_dist.ratio import ratio, shown
from knapspec_dist.runtime.dispatch import Outcome
from knapspec_dist.runtime.messages import KVReport

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """A log line every ``every`` seconds (rows done, tokens/s, ETA) and an optional tqdm bar."""

    total: int
    every: float
    label: str
    bar_enabled: bool | None = None
    max_new_tokens: int = 128
    live: Callable[[], Work | None] | None = None  # what the replicas have done so far
    slots: int | None = None  # rows decoding at once over all replicas
    replicas: int = 1
    prompt_tokens: int | None = None  # prompt tokens of the pass's rows (None: not counted)
    memory: Callable[[], KVReport | None] | None = None  # the replicas' KV cache and its use
    generations_total: int | None = None  # the pass's expected generations (None: one a row)
    skipped: int = 0  # rows that failed on their input: written as failed, never generated
    clock: Callable[[], float] = time.monotonic
    window: float = 120.0  # seconds of work the rates are measured over
    done: int = 0
    failed: int = 0
    finished_tokens: int = 0  # generated tokens of the rows finished in this pass
    generations: int = 0  # generations finished: a row each, or each node of a summary tree
    work: Work = field(default_factory=Work)
    start: float = field(default=None)
    last: float = field(default=None)

    def __post_init__(self):
        self.start = self.clock() if self.start is None else self.start
        self.last = self.start if self.last is None else self.last
        self.bar = None
        self.kv: KVReport | None = None  # the last ``memory`` report
        self.history: deque[tuple[float, Work]] = deque([(self.start, Work())])  # live reports
        enabled = sys.stderr.isatty() if self.bar_enabled is None else self.bar_enabled
        if enabled and self.total:
            self.bar = tqdm(total=self.total, desc=self.label, unit="row", file=sys.stderr,
                            dynamic_ncols=True)

    def add_tokens(self, outcome: Outcome) -> None:
        """A generation that is not a row of its own finished (a summary tree's node)."""
        if outcome.result is not None and outcome.error is None:
            self.finished_tokens += outcome.result.stats.new_tokens
            self.generations += 1

    def update(self, outcome: Outcome) -> None:
        """A row finished (a tree's row: its nodes' tokens came by :meth:`add_tokens`)."""
        self.done += 1
        if outcome.error is not None:
            self.failed += 1
        else:
            self.add_tokens(outcome)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(tok_s=shown(self.tokens_per_s, ".1f", "?"), failed=self.failed)
        self.tick()

    @property
    def tokens(self) -> int:
        """Tokens generated in this pass so far: the live count, never less than the finished
        rows' (the live count of a restarted replica starts again)."""
        return max(self.work.emitted, self.finished_tokens)

    @property
    def tokens_per_s(self) -> float | None:
        return ratio(self.tokens, self.clock() - self.start)

    def eta(self) -> float | None:
        """Seconds left (None until the rates are known): see the module docstring."""
        w = self.work
        if w.decode_s > 0 and w.prefill_s > 0 and w.decoded > 0:
            recent = self.recent()
            p = recent if recent.prefill_s > 0 and recent.prefilled > 0 else w
            d = recent if recent.decode_s > 0 and recent.decoded > 0 else w
            # one row's tokens per second: its tokens per round over the seconds of a round
            row_rate = (d.decoded / d.row_rounds) / (d.decode_s / d.rounds)
            left = max(0, (self.prompt_tokens or 0) - w.prefilled)
            prefill = left * (p.prefill_s / self.replicas) / p.prefilled if left else 0.0
            rate = d.decoded / (d.decode_s / self.replicas)  # over all rows, replicas together
            return prefill + self._decoding_s(rate, row_rate)
        rate = self.tokens_per_s
        if self.live is not None or not rate or self.tokens < min(self.slots or 1, self.total):
            return None
        # the wall-clock rate, with every slot assumed busy
        return self._decoding_s(rate, rate / min(self.slots or 1, self.total))

    def recent(self) -> Work:
        """The work of the last ``window`` seconds: the latest report less the first one kept,
        the newest at least that old (the pass's start while it is younger: ``_remember``). A
        replica restarted in the window counts again from zero: then the latest report as it
        stands."""
        latest = self.history[-1][1]
        delta = latest - self.history[0][1]
        if any(getattr(delta, f.name) < 0 for f in fields(delta)):
            return latest
        return delta

    def _remember(self, now: float, work: Work) -> None:
        """Keep the live reports the window needs: the newest one older than it, and after."""
        self.history.append((now, work))
        while len(self.history) > 2 and self.history[1][0] <= now - self.window:
            self.history.popleft()

    def _decoding_s(self, rate: float, row_rate: float) -> float:
        """Seconds of decoding left, at ``rate`` tokens per second over all rows (when there
        are no ``slots`` to count waves in) or ``row_rate`` for one decoding row."""
        per_row = (self.finished_tokens / self.generations if self.generations
                   else self.max_new_tokens)  # tokens of one generation (a row, a node)
        generated = max(0, self.tokens - self.finished_tokens)  # by the unfinished rows
        rows_left = (self.total - self.done - self.skipped if self.generations_total is None
                     else max(0, self.generations_total - self.generations))
        slots = self.in_flight()
        if not slots:
            return max(0.0, rows_left * per_row - generated) / rate
        flying = min(slots, rows_left)
        if not flying:
            return 0.0
        waves = -(-(rows_left - flying) // slots)
        done_each = generated / flying
        # A row still decoding has outlived the early finishers: expect at least half of what
        # its budget leaves, not the finished rows' mean (which early EOS rows pull down).
        ahead = max(per_row - done_each, (self.max_new_tokens - done_each) / 2, 0.0)
        steps = ahead + waves * per_row
        return steps / row_rate

    def in_flight(self) -> int | None:
        """Rows decoding at once over the replicas: the row cap, or once rows have waited for
        memory, the most the replicas' pools held at once."""
        kv = self.kv
        if self.slots and kv is not None and kv.rows_waited and kv.peak_rows:
            return min(self.slots, kv.peak_rows * self.replicas)
        return self.slots

    def tick(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self.last < self.every:
            return
        self.last = now
        if self.live is not None:
            work = self.live()
            if work is not None:
                self.work = work
                self._remember(now, work)
        if self.memory is not None:
            self.kv = self.memory() or self.kv
        eta, w = self.eta(), self.work
        prefill = ""
        if self.prompt_tokens and w.prefilled < self.prompt_tokens:  # a prefill-heavy job's rate
            rate = ratio(w.prefilled, w.prefill_s / self.replicas)
            prefill = (f"prefilled {w.prefilled}/{self.prompt_tokens} prompt tokens "
                       f"({shown(rate, '.0f', '?')} tok/s), ")
        # rows summarized through trees take several generations each: say how many ran
        expected = self.generations_total
        generations = (f", {self.generations}/~{expected} generations"
                       if expected is not None and expected > self.total - self.skipped
                       else f", {self.generations} generations"
                       if self.generations != self.done - self.failed else "")
        log.info("%s: %d/%d rows (%d failed%s), %s%d tokens, %s tok/s, elapsed %s, ETA %s%s",
                 self.label, self.done + self.skipped, self.total, self.failed + self.skipped,
                 generations, prefill,
                 self.tokens,
                 shown(self.tokens_per_s, ".1f", "?"), _hms(now - self.start),
                 _hms(eta) if eta is not None else "?", kv_line(self.kv))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.tick(force=True)


@dataclass
class Workload:
    """The work of the rows a pass streamed so far: the rows, the generations they are
    expected to take (see the module docstring) and their prompt tokens."""

    rows: int = 0
    generations: int = 0
    prompt_tokens: int = 0

    def add(self, rows: int = 0, generations: int = 0, prompt_tokens: int = 0) -> None:
        self.rows += rows
        self.generations += generations
        self.prompt_tokens += prompt_tokens

    def expected(self, rows: int) -> tuple[int, int]:
        """Generations and prompt tokens of ``rows`` rows: these, and the rows not streamed
        yet at these rows' mean."""
        more = max(0, rows - self.rows) / self.rows if self.rows else 0.0
        return (round(self.generations * (1 + more)),
                round(self.prompt_tokens * (1 + more)))


def kv_line(kv: KVReport | None) -> str:
    """The progress line's KV part: the pool, its peak use, rows in flight, waits."""
    if kv is None:
        return ""
    pool = (f"{kv.pages} pages of {kv.page_size}" if kv.paged
            else f"{kv.pages} slots of {kv.page_size}")
    return (f"; KV cache {kv.tokens} tokens ({pool}, {kv.bytes / 2 ** 30:.2f} GiB per rank), "
            f"peak {kv.peak_use:.0%}, rows in flight {kv.mean_rows:.1f} mean / {kv.peak_rows} "
            f"peak, {kv.memory_wait_s:.1f}s waiting for memory")


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")
