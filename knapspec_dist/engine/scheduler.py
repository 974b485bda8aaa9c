"""Continuous batching: up to ``max_num_seqs`` rows decode together, and a row that finishes
makes room for the next at once.

Each ``step``: admit waiting rows into free slots and prefill them, one at a time at the slot
after the decoding rows (with a paged cache, a row also waits until the free pages cover all it
can need, engine/pages.py; first come, first served, so the order is the same every run), up to
``max_num_batched_tokens`` prompt tokens per step (the config's, else the device's default:
``default_max_num_batched_tokens``; a long prompt is cut into chunks of that many tokens
across steps, so it never stalls the decoding rows for its whole prefill; short ones are
admitted several per step); then one round of the strategy over every decoding row; then
retire the rows that finished. A row's chunks start at multiples of the budget: a chunk that
does not fit what is left of a step's budget waits, whole, for the next step. So a row's chunks
depend on its prompt alone, never on its neighbours, a prompt within the budget is one fresh
prefill (the causal kernel, which skips the masked half: docs/batching.md), and a job's
progress sees a long prompt's prefill chunk by chunk. Every strategy runs through this loop,
batch 1 included.

Throughput (``Work``): the finished rows' tokens over the wall time from the first admission
to the last finish, and the same over the time spent in decoding rounds only (prefill
excluded).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch

from knapspec_dist.clock import Clock
from knapspec_dist.engine.generation import (
    GenerationConfig,
    GenerationResult,
    check_prompt,
    finish,
)
from knapspec_dist.engine.memory import plan_for
from knapspec_dist.engine.model_runner import ModelRunner, prefill
from knapspec_dist.engine.pages import KVUse, PagePool, Paging
from knapspec_dist.engine.sampling import choose, prompt_keys, row_seed
from knapspec_dist.engine.sequence import Batch, Row, row_capacity
from knapspec_dist.engine.strategy import Strategy
from knapspec_dist.errors import UserError
from knapspec_dist.model.cache import kv_heads
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.model.transfer import upload
from knapspec_dist.ratio import ratio

log = logging.getLogger(__name__)



def default_max_num_batched_tokens(device: torch.device) -> int:
    """Prompt tokens one step prefills when the config names no budget: 8192 on both.

    CUDA: to keep B rows in flight, a step must admit rows as fast as they finish, i.e.
    prefill B x prompt / rounds-per-row tokens; at 256 rows of 4k-token documents with 512 new
    tokens that is 2048 a step for plain decoding and ~3x more when speculation emits ~3 tokens
    a round; 8192 is vLLM's offline default, and still one forward of a few tens of ms on an
    H200. CPU: each row's chunk is its own forward, and a prompt within the budget is one fresh
    prefill, whose causal kernel skips the masked half that a later chunk's mask computes
    (docs/batching.md has the 12 bundled chapters at both). The cost is latency, not
    throughput: the decoding rows wait for a long prompt's one forward."""
    return 8192


def max_num_batched_tokens(config: GenerationConfig, device: torch.device) -> int:
    """The prompt-token budget of a step: the config's, else the device's default."""
    return config.max_num_batched_tokens or default_max_num_batched_tokens(device)


@dataclass
class Work:
    """What a scheduler has done so far: tokens emitted by every row (finished or not, for a
    job's live progress and ETA), prompt tokens prefilled, and the seconds each took; the
    decoding rounds, with the rows that decoded in each summed (``row_rounds``), so that one
    row's rate is known however few rows decode at once; and its throughput, the finished
    rows' tokens over the wall time from the first admission to the last finish. Deltas and
    sums over calls and replicas are field by field."""

    emitted: int = 0  # by prefills (a row's first token) and rounds
    prefilled: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0  # time in decoding rounds
    decoded: int = 0  # emitted by rounds only
    rounds: int = 0
    row_rounds: int = 0  # decoding rows summed over rounds
    finished: int = 0  # generated tokens of the finished rows
    wall_s: float = 0.0  # first admission to last finish (summed: the replicas' together)

    @property
    def tokens_per_s(self) -> float | None:
        return ratio(self.finished, self.wall_s)

    @property
    def decode_tokens_per_s(self) -> float | None:
        return ratio(self.finished, self.decode_s)

    @property
    def mean_batch(self) -> float | None:
        return ratio(self.row_rounds, self.rounds)

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "mean_batch": self.mean_batch}

    def __add__(self, other: Work) -> Work:
        return Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: Work) -> Work:
        return Work(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


class Scheduler:
    def __init__(self, strategy: Strategy, model: Transformer, config: GenerationConfig,
                 max_num_seqs: int, capacity: int, *,
                 runner: ModelRunner | None = None, clock: Clock | None = None,
                 paging: Paging | None = None):
        """``capacity``: cache positions per row (see ``row_capacity``); rows needing more
        are refused one by one. ``runner``: the model's runner, with its cache and graphs,
        when one is kept across schedulers (graphs stay captured); else a new one.
        ``clock``: what times the rounds (a test's simulated one); else the device's.
        ``paging``: a paged cache of that pool, rows admitted as its free pages cover them
        (``capacity`` then bounds one row); None: ``max_num_seqs`` fixed slots."""
        if max_num_seqs < 1:
            raise UserError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.strategy, self.model, self.config = strategy, model, config
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens(config, model.device)
        self.runner = runner if runner is not None else ModelRunner(model)
        cache = self.runner.new_cache(max_num_seqs, capacity, kv_heads(model), paging)
        self.batch = Batch(cache, pool=PagePool(cache) if paging is not None else None)
        self.capacity = self.batch.cache.capacity
        self.waiting: deque[Row] = deque()
        self.timer = clock if clock is not None else Clock(model.device)
        self.work = Work()  # so far, finished rows or not (progress), and the throughput
        self.use = KVUse()  # the cache's peaks and the waits for memory (a caller may reset it)
        self._blocked: float | None = None  # since when the queue's head waits for pages
        self._first: float | None = None
        strategy.start(model)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.batch.rows or self.batch.prefilling)

    def add(self, rid: int, prompt: list[int], key: object = None) -> None:
        """Queue a row; a prompt that cannot be generated raises ``UserError`` (for that row).
        ``key`` names the row for its sampling seed (``row_seed(config seed, key)``); None:
        the row id."""
        limit = check_prompt(self.model, prompt, self.config)
        need = row_capacity(len(prompt), limit)
        if need > self.capacity:
            raise UserError(f"prompt of {len(prompt)} tokens with {limit} new tokens needs "
                            f"{need} cache positions; this engine holds {self.capacity} per row")
        pool = self.batch.pool
        if pool is not None and pool.pages_for(need) > pool.total:
            raise UserError(f"prompt of {len(prompt)} tokens with {limit} new tokens needs "
                            f"{need} cache positions; the KV pool holds {pool.tokens}")
        seed = row_seed(self.config.sampling.seed, rid if key is None else key)
        self.waiting.append(Row(rid, list(prompt), limit, seed))

    def run(self, prompts: list[list[int]], on_step: Callable[[Scheduler], None] | None = None
            ) -> list[GenerationResult]:
        """Generate every prompt (all checked before any runs); results in input order, each
        row keyed by ``prompt_keys``. ``on_step`` sees the scheduler after each step (a
        benchmark's clock: tools/peer/compare.py)."""
        for rid, (prompt, key) in enumerate(zip(prompts, prompt_keys(prompts))):
            self.add(rid, prompt, key=key)
        done: dict[int, GenerationResult] = {}
        while self.busy:
            for row in self.step():
                done[row.rid] = result(row)
            if on_step is not None:
                on_step(self)
        return [done[i] for i in range(len(prompts))]

    def step(self) -> list[Row]:
        """Admit, prefill a chunk, run one round; the rows that finished."""
        b, timer = self.batch, self.timer
        finished: list[Row] = []
        budget = self.max_num_batched_tokens  # prompt tokens this step (>= 1: progress)
        while True:
            if b.prefilling is None and self.waiting and b.size < self.max_num_seqs \
                    and self._fits(self.waiting[0]):
                row = b.prefilling = self.waiting.popleft()
                if b.pool is not None:
                    b.pool.admit(b.size, row_capacity(len(row.prompt), row.limit))
                row.admitted_s = timer.now()
                row.stats.admitted_at = time.time()
                self._note_admission(row.admitted_s)
                if self._first is None:
                    self._first = row.admitted_s
            if b.prefilling is None or budget <= 0:
                if self.waiting and not b.rows and b.prefilling is None:
                    # add() refuses a row bigger than the empty pool: pages were lost
                    raise RuntimeError(f"{len(b.pool.free)} of {b.pool.total} pages free with "
                                       "no row holding any")
                break
            left = len(b.prefilling.prompt) - b.prefilling.prefilled
            n = min(left, self.max_num_batched_tokens)
            if n > budget:  # the row's next chunk waits for a step of its own, whole
                break
            budget -= n
            row = self._prefill_chunk(n)
            if row is not None and row.reason is not None:  # done at its first token
                finished.append(row)
        if b.rows:
            start = timer.mark()
            emitted = sum(len(r.out) for r in b.rows)
            size = b.size
            self.strategy.round(self.model, b, self.config, self.runner, timer)
            end = timer.mark()
            timer.sync()  # a round ends with its read-back: nothing is left to wait for
            elapsed = timer.seconds(start, end)
            after = sum(len(r.out) for r in b.rows)
            b.progress += (after - emitted) / size
            w = self.work
            w.emitted += after - emitted
            w.decoded += after - emitted
            w.decode_s += elapsed
            w.rounds += 1
            w.row_rounds += size
            for r in b.rows:
                r.stats.rounds += 1
                r.stats.mean_batch += size
            done = [r for r in b.rows if r.reason is not None]
            if done:
                b.retire(done)
                finished.extend(done)
        now = timer.now()
        for row in finished:
            row.finished_s = now
            row.stats.finished_at = time.time()
            self.work.finished += len(row.out)
            self.work.wall_s = now - self._first
            self.strategy.retired(row.rid)
        return finished

    def _fits(self, row: Row) -> bool:
        """Whether the free pages cover the row's reservation (always, with fixed slots):
        the head of the queue waits for them, rows behind it do not go first."""
        pool = self.batch.pool
        fits = pool is None or pool.fits(row_capacity(len(row.prompt), row.limit))
        if not fits and self._blocked is None:
            self._blocked = self.timer.now()
        return fits

    def _note_admission(self, now: float) -> None:
        """``use`` after a row was admitted: the wait it ended, the peaks it may have set."""
        b, use = self.batch, self.use
        if self._blocked is not None:
            use.wait_s += now - self._blocked
            use.waited += 1
            self._blocked = None
        rows = b.size + 1  # the decoding rows and the one just admitted
        held = b.pool.reserved * b.pool.page if b.pool is not None else rows * self.capacity
        use.peak_tokens = max(use.peak_tokens, held)
        use.peak_rows = max(use.peak_rows, rows)

    def _prefill_chunk(self, n: int) -> Row | None:
        """``n`` more prompt tokens of the prefilling row; when its prompt is in, its first
        token is chosen and it joins the decoding rows (or is returned finished, having left
        its slot)."""
        b, row, timer = self.batch, self.batch.prefilling, self.timer
        start = timer.now()
        slot = b.size
        logits = prefill(self.model, b.cache, slot, row.prompt[row.prefilled:row.prefilled + n],
                         row.prefilled)
        row.prefilled += n
        joined = None
        if row.prefilled == len(row.prompt):
            dev = logits.device
            first = choose(logits[None], self.config.sampling,
                           upload([row.seed], dev),
                           torch.zeros(1, dtype=torch.int64, device=dev)).tolist()
            row.out, row.reason = finish(first, row.limit, self.model, self.config)
            self.work.emitted += len(row.out)
            if row.reason is None:
                b.join()
                self.strategy.admitted(row.rid)
            else:
                b.prefilling = None
                b.free(slot)
            joined = row
        elapsed = timer.now() - start
        row.stats.prefill_s += elapsed
        self.work.prefilled += n
        self.work.prefill_s += elapsed
        return joined


def result(row: Row) -> GenerationResult:
    s = row.stats
    s.prompt_tokens, s.new_tokens = len(row.prompt), len(row.out)
    s.wall_s = row.finished_s - row.admitted_s
    s.mean_batch = ratio(s.mean_batch, s.rounds)
    if s.drafted:  # summed per judged draft by the round: now the mean per draft
        s.attention_skipped /= s.drafted
        s.mlp_skipped /= s.drafted
    return GenerationResult(row.out, s, row.reason)


def generate(strategy: Strategy, model: Transformer, prompts: list[list[int]],
             config: GenerationConfig, *, max_num_seqs: int | None = None,
             runner: ModelRunner | None = None, clock: Clock | None = None,
             paging: Paging | None = None) -> list[GenerationResult]:
    """Generate for every prompt with ``strategy``, ``max_num_seqs`` rows at a time (None:
    all of them, as far as memory holds them: engine/memory.py); results in input order."""
    capacity = max((row_capacity(len(p), max(1, config.max_new_tokens)) for p in prompts),
                   default=1)
    rows = max_num_seqs or min(max(1, len(prompts)),
                               max(1, plan_for(model, capacity, paged=False).max_num_seqs))
    return Scheduler(strategy, model, config, rows, capacity, runner=runner,
                     clock=clock, paging=paging).run(prompts)
