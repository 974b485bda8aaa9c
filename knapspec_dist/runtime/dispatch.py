"""Spread rows over the engine's replicas, actor-pool style, with retries after replica failures.

Why an actor pool and not Ray Data: a replica is a long-lived TP group (a placement group,
a coordinator and ``tp`` shard actors holding the weights) that the RayEngine already owns and
can restart; the jobs layer only has to keep each replica busy and notice when one dies.
Ray Data's ``map_batches`` would need its own actor per replica wrapping the RayEngine's
actors, would re-run whole batches on failure (so one dead shard recomputes its batch
neighbours), and its streaming order would fight "longest documents first".  A driver-side
pool is a few dozen lines, keeps exactly-once bookkeeping in one place, and costs one Ray
call per row.

The loop: rows wait in a queue, read lazily from the job's stream (each streamed batch
longest prompt first: long rows started first finish before the tail). The tasks of rows
already started (a summary tree's nodes, retries) wait in a front queue of their own, and
the two share the replicas fairly (see :class:`Dispatcher`): a book's hundreds of chunk
summaries never hold back the short rows behind it.  Each replica gets up to
``max_inflight`` rows at a time (2 by default: the next row is already queued on the replica
when one finishes).  When a row's call fails because its replica died (a shard or
coordinator actor crashed), the replica is restarted once (later failures of its other rows
from the same incarnation do not restart it again) and every row it held goes back to the
front of the queue, to be retried alone on an idle replica (see :class:`Dispatcher`); a row
that saw ``max_attempts`` replica failures is failed with an error instead of retried
forever (a poison row must not kill the job, nor take its neighbours with it).  A row's own
error (a UserError from the strategy, any other exception from its generation) becomes its
error row.  Each row is handed to ``on_result`` exactly once.

Out of memory (a shard's torch.OutOfMemoryError or MemoryError, Ray's OOM killer) is a
replica failure too: the replica is restarted smaller (the backend halves its KV cache and
its ``max_num_seqs``) and its rows are retried.  A row that still fails is written with a
retryable ``kind`` (``oom``, ``replica``, ``timeout``), which a rerun retries.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.runtime.backend import describe_error

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What the dispatcher needs from an engine (runtime/backend.py's ``EngineBackend``;
    the tests' fakes)."""

    num_replicas: int

    def submit(self, replica: int, prompt_ids: list[int], config: GenerationConfig,
               key: object = None) -> Any: ...

    def wait(self, handles: list, timeout: float) -> list: ...

    def result(self, handle) -> Any: ...

    def restart(self, replica: int, smaller: bool = False) -> None: ...
    # smaller: after an out-of-memory failure, with a smaller batch if it can

    def is_replica_failure(self, exc: BaseException) -> bool: ...

    def is_out_of_memory(self, exc: BaseException) -> bool: ...  # optional (False)


def _as_list(ids) -> list[int]:
    """Token ids as a list (a streamed row keeps them as a NumPy view until submitted)."""
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


@dataclass
class Task:
    key: Any  # row id
    prompt_ids: list[int]  # or a 1-d NumPy array
    attempts: int = 0  # submissions
    failures: int = 0  # replica failures seen while this row was on the replica
    last_failure: str = ""
    continues: bool = False  # of a row already started (a tree's node): run even when stopping

    @property
    def row(self) -> Any:
        """The row this task generates for (a tree's node: its document's)."""
        return self.key


@dataclass
class Outcome:
    task: Task
    result: Any = None  # GenerationResult on success
    error: str | None = None
    replica: int | None = None
    kind: str | None = None  # of the error: row | oom | replica | timeout


@dataclass
class _Flight:
    task: Task
    replica: int
    epoch: int
    started: float
    alone: bool  # a suspect row, running with nothing else on its replica


class ReplicaLost(RuntimeError):
    """No replica is left to run the remaining rows (they stay pending for a resume)."""


class Dispatcher:
    """Runs tasks over ``backend``'s replicas; see the module docstring.

    Fairness: when rows not yet started (the queue) and tasks of started rows (the front: a
    summary tree's nodes) both wait, free slots go to each in turn. A row thus starts no
    later than it would with no tree in the job, except that each start before it may be
    followed by one tree node's: at most one node per row ahead of it (plus the tasks in
    flight). A retried task (its replica failed) goes first, and the front keeps its own
    order (runtime/tree_tasks.py: the node nearest its tree's root first).

    Blame: when a replica dies, every row it held saw the failure, but only one may have
    caused it.  A row that saw a failure becomes a suspect and is retried *alone* on an
    idle replica, so a poison row exhausts its own ``max_attempts`` while the rows that
    merely shared a replica with it succeed on their next (solo) try.
    """

    def __init__(self, backend: Backend, config: GenerationConfig, *, max_inflight: int = 2,
                 max_attempts: int = 3, row_timeout: float | None = None,
                 restart_tries: int = 3, restart_backoff: float = 2.0,
                 tick_seconds: float = 1.0):
        self.backend = backend
        self.config = config
        self.max_inflight = max_inflight
        self.max_attempts = max_attempts
        self.row_timeout = row_timeout
        self.restart_tries = restart_tries
        self.restart_backoff = restart_backoff
        self.tick_seconds = tick_seconds
        n = backend.num_replicas
        self.epoch = [0] * n  # incarnation of each replica
        self.alive = [True] * n
        self.load = [0] * n
        self.alone = [False] * n  # running a suspect row: take nothing else
        self.restarts = 0
        self.lost = 0  # replicas given up (they could not restart: a node gone, no room)
        self.retried_rows = 0
        self.queue: deque[Task] = deque()
        self.front: deque[Task] = deque()  # tasks of rows already started (push)
        self.inflight: dict[Any, _Flight] = {}
        self.rows_turn = True  # the next start, if both wait, is a new row's (_waiting)

    def run(self, tasks: Iterable[Task], on_result: Callable[[Outcome], None],
            on_tick: Callable[[], None] | None = None,
            should_stop: Callable[[int], bool] | None = None,
            lookahead: int = 64) -> None:
        """Run ``tasks`` (in priority order; an iterator is read lazily, ``lookahead`` rows
        beyond what the replicas hold, so a streamed input is never read ahead of need)
        until every one reached ``on_result``.

        ``should_stop(finished + in flight)`` may end the run early: no new row is started
        and the rows in flight are finished and reported.
        """
        self.source = iter(tasks)
        self.lookahead = lookahead
        self.queue = deque()
        self.front = deque()
        self.inflight = {}
        self.rows_turn = True
        self._finished = 0
        self._on_result = on_result
        try:
            stopping = False
            full = None if should_stop is None else (
                lambda: should_stop(self._finished + len(self.inflight)))
            self._top_up(full, ahead=False)  # the first rows start before the lookahead is read
            while self.queue or self.front or self.inflight:
                if (should_stop is not None and not stopping
                        and should_stop(self._finished + len(self.inflight))):
                    stopping = True
                    if self.queue:
                        log.info("stopping early: %d queued row(s) and the rest of the input "
                                 "left for a later run", len(self.queue))
                    self.front.extend(t for t in self.queue if t.continues)
                    self.queue.clear()
                    self.source = iter(())
                self._fill(full)
                if not self.inflight:
                    if self.queue or self.front:
                        raise ReplicaLost(f"no replica left to run "
                                          f"{len(self.queue) + len(self.front)} row(s)")
                    break
                for handle in self.backend.wait(list(self.inflight), self.tick_seconds):
                    flight = self._land(handle)
                    try:
                        result = self.backend.result(handle)
                    except Exception as exc:  # noqa: BLE001 - sorted into replica vs row failures
                        if self.backend.is_replica_failure(exc):
                            self._retry_or_fail(flight, exc)
                            self._restart(flight.replica, flight.epoch, exc)
                        else:
                            self._emit(Outcome(flight.task, error=describe_error(exc),
                                               replica=flight.replica, kind="row"))
                        continue
                    self._emit(Outcome(flight.task, result=result, replica=flight.replica))
                self._check_timeouts()
                if on_tick is not None:
                    on_tick()
                if not stopping:
                    self._top_up(full)
        finally:  # the caller's callbacks and input are not kept: a stage holding this
            # dispatcher would otherwise be in a cycle, freed only by the garbage collector
            self._on_result, self.source = None, iter(())

    def push(self, task: Task, first: bool = True) -> None:
        """A task of a row already started (a summary tree's node), made while the run goes:
        submitted before the queue's (``first``: before the others pushed too), and also once
        ``should_stop`` holds (the rows in flight are finished). Their rows count in the
        lookahead, a tree's nodes as one row (:meth:`_may_read`)."""
        if first:
            self.front.appendleft(task)
        else:
            self.front.append(task)

    def drop(self, unwanted: Callable[[Task], bool]) -> None:
        """Take the waiting tasks that are ``unwanted`` out (a failed tree's other nodes)."""
        self.queue = deque(t for t in self.queue if not unwanted(t))
        self.front = deque(t for t in self.front if not unwanted(t))

    def _top_up(self, full: Callable[[], bool] | None = None, ahead: bool = True) -> None:
        """Pull rows from the source while fewer than the replicas' room plus ``lookahead``
        wait (backpressure: a streamed input is read as the replicas take rows). A row is
        submitted as soon as it is pulled while a replica has room: the first row of a
        streamed input starts without waiting for the rows queued behind it, and no row is
        pulled once ``full()`` (``--stop-after`` reached)."""
        while self._may_read(ahead) and (full is None or not full()):
            if not self._read():
                return
            if len(self.inflight) < self.max_inflight * sum(self.alive):
                self._fill(full)

    def _read(self) -> bool:
        """One row from the source into the queue; False once the source is exhausted."""
        task = next(self.source, None)
        if task is not None:
            self.queue.append(task)
        return task is not None

    def _may_read(self, ahead: bool) -> bool:
        """Whether another row may be read: fewer rows wait than the room (``ahead``: plus
        the lookahead; else less what is in flight), a started tree counting as one row (its
        hundreds of chunks are one document's); and while a started row's tasks wait with no
        new row beside them, one row more, so that the two always take turns (up to as many
        started trees as rows may wait: a book-only input never expands every book)."""
        room = self.max_inflight * sum(self.alive)
        limit = room + self.lookahead if ahead else room - len(self.inflight)
        started = len({t.row for t in self.front})
        if self.front and not self.queue:
            return started <= room + self.lookahead
        return len(self.queue) + started < limit

    def _waiting(self, full: Callable[[], bool] | None) -> deque | None:
        """The queue the next start takes from (None: nothing may start): the front and the
        queue in turn while both wait (the class docstring's fairness), a retry first. On a
        row's turn with none queued, a row is read from the input first: else a wide replica
        would fill every free slot with a book's chunks before the rows behind it were read."""
        may_start = full is None or not full()
        if self.rows_turn and self.front and not self.queue and may_start and self._may_read(True):
            self._read()  # a row's turn: read one, not a slot to the front
        rows = bool(self.queue) and may_start
        if self.front and (not rows or self.front[0].failures or not self.rows_turn):
            return self.front
        return self.queue if rows else None

    def _emit(self, outcome: Outcome) -> None:
        self._finished += 1
        self._on_result(outcome)

    def _land(self, handle) -> _Flight:
        flight = self.inflight.pop(handle)
        self.load[flight.replica] -= 1
        if flight.alone:
            self.alone[flight.replica] = False
        return flight

    def _fill(self, full: Callable[[], bool] | None = None) -> None:
        """Submit queued rows while a replica has room (and ``full()`` says more may start)."""
        while (waiting := self._waiting(full)) is not None:
            task = waiting[0]
            suspect = task.failures > 0
            candidates = [r for r in range(len(self.load)) if self.alive[r] and (
                self.load[r] == 0 if suspect
                else self.load[r] < self.max_inflight and not self.alone[r])]
            if not candidates:
                return  # a suspect waits for an idle replica; the rest wait behind it
            replica = min(candidates, key=lambda r: (self.load[r], r))
            waiting.popleft()
            self.rows_turn = waiting is self.front
            task.attempts += 1
            epoch = self.epoch[replica]
            try:
                handle = self.backend.submit(replica, _as_list(task.prompt_ids), self.config,
                                             task.key)
            except Exception as exc:  # noqa: BLE001
                if not self.backend.is_replica_failure(exc):
                    raise
                self._retry_or_fail(_Flight(task, replica, epoch, time.monotonic(), suspect),
                                    exc)
                self._restart(replica, epoch, exc)
                continue
            self.inflight[handle] = _Flight(task, replica, epoch, time.monotonic(), suspect)
            self.load[replica] += 1
            self.alone[replica] = suspect

    def _oom(self, exc: BaseException) -> bool:
        check = getattr(self.backend, "is_out_of_memory", None)
        return bool(check is not None and check(exc))

    def _retry_or_fail(self, flight: _Flight, exc: BaseException) -> None:
        """A row whose replica failed: back to the front of the queue, or failed (with a
        retryable kind: a rerun tries it again)."""
        task = flight.task
        task.failures += 1
        task.last_failure = describe_error(exc)
        if task.failures >= self.max_attempts:
            kind = ("oom" if self._oom(exc) else
                    "timeout" if isinstance(exc, TimeoutError) else "replica")
            log.error("row %r failed: its replica failed %d time(s) while generating it (%s); "
                      "a rerun retries it", task.key, task.failures, task.last_failure)
            self._emit(Outcome(task, error=(
                f"replica failed {task.failures} time(s) while generating this row; "
                f"last: {task.last_failure}"), replica=flight.replica, kind=kind))
        else:
            self.retried_rows += 1
            self.front.appendleft(task)  # a row already started: first, even when stopping

    def _restart(self, replica: int, epoch: int, exc: BaseException) -> None:
        if epoch != self.epoch[replica] or not self.alive[replica]:
            return  # this incarnation was already replaced (or given up)
        oom = self._oom(exc)
        log.warning("replica %d failed (%s); restarting it%s and retrying its rows",
                    replica, describe_error(exc), " with a smaller batch" if oom else "")
        for attempt in range(1, self.restart_tries + 1):
            try:
                t0 = time.monotonic()
                if oom:
                    self.backend.restart(replica, smaller=True)
                else:
                    self.backend.restart(replica)
                self.epoch[replica] += 1
                self.restarts += 1
                log.warning("replica %d restarted in %.1f s", replica, time.monotonic() - t0)
                return
            except Exception as e:  # noqa: BLE001
                log.error("restarting replica %d failed (try %d/%d): %s", replica, attempt,
                          self.restart_tries, describe_error(e))
                time.sleep(self.restart_backoff * attempt)
        self.alive[replica] = False
        self.epoch[replica] += 1
        self.lost += 1
        log.error("giving up on replica %d; %d replica(s) left", replica, sum(self.alive))

    def _check_timeouts(self) -> None:
        if self.row_timeout is None:
            return
        now = time.monotonic()
        stale = {f.replica: f.epoch for f in self.inflight.values()
                 if now - f.started > self.row_timeout and f.epoch == self.epoch[f.replica]}
        for replica, epoch in stale.items():
            err = TimeoutError(f"no answer from replica {replica} within --row-timeout "
                               f"{self.row_timeout:g} s")
            # Everything the hung replica holds is retried; the restart kills its actors, so
            # the old calls can never deliver a second result (and they are forgotten here).
            for handle in [h for h, f in self.inflight.items() if f.replica == replica]:
                self._retry_or_fail(self._land(handle), err)
            self._restart(replica, epoch, err)
