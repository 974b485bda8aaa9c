"""The generation passes of a job: the main pass over the input's stream, then the two
baseline passes; each a stream of prompt batches (the processor's tokenize stage) fed to
the replicas by the Dispatcher, every finished row to a part writer.

:class:`GenerationPasses` owns what streaming the rows needs (the rows in flight, the input
errors held until an engine started, the part writers) and is given what the job's checks
found (jobs/runner.py ``JobRun``: options, input, output, the rows done, the lease); it
counts what it did into the run's :class:`~knapspec_dist.jobs.result.JobResult`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from knapspec_dist.jobs.baseline import baseline_ids
from knapspec_dist.jobs.inputs import InputScan, iter_texts
from knapspec_dist.jobs.lease import Lease
from knapspec_dist.jobs.options import JobConfig
from knapspec_dist.jobs.output import OutputDir, PartWriter, result_row
from knapspec_dist.jobs.progress import Progress, Workload
from knapspec_dist.jobs.result import JobResult
from knapspec_dist.jobs.resume import Done
from knapspec_dist.jobs.termination import check_terminate
from knapspec_dist.jobs.trees import read_known, tree_dispatch
from knapspec_dist.runtime.dispatch import Dispatcher, Outcome, Task
from knapspec_dist.runtime.prompts import PromptBuilder, TokenizeStage, make_builder
from knapspec_dist.runtime.stages import Stage, batch_tasks, outcome_columns
from knapspec_dist.runtime.stream import stream_batches
from knapspec_dist.runtime.tree import DocumentTree
from knapspec_dist.runtime.tree_tasks import NodeTask, TreeDispatch, TreeTask, tree_row
from knapspec_dist.speculation.options import StrategyOptions

log = logging.getLogger(__name__)

AR = StrategyOptions(name="ar")  # the baseline every speedup is measured against


def _missing(ids: pa.Array, done: pa.Array) -> pa.Array:
    """``ids`` not in ``done`` (an anti-join)."""
    return ids.filter(pc.invert(pc.is_in(ids, value_set=done.cast(ids.type))))


@dataclass
class Pass:
    """One generation pass of a job: its rows' strategy, where they are written, how the
    progress names it, and what it counts as each row is generated."""

    label: str  # in progress lines: "rows", "baseline (ar)"
    strategy: str
    writer: PartWriter
    count: Callable[[], None]  # one more row generated (the result's count, kept live)
    stop_after: int | None = None  # rows this run writes at most
    on_row: Callable[[dict], None] | None = None
    reports_kv: bool = False  # its KV cache's use goes into the summary (the main pass)


@dataclass
class Writers:
    """The part writers of a job's three passes."""

    rows: PartWriter  # the main pass
    baseline: PartWriter  # the baseline rows with ar
    again: PartWriter  # the baseline rows with the job's strategy, batched as ar's
    nodes: PartWriter  # the summary trees' nodes, of every pass (jobs/trees.py)

    def __iter__(self) -> Iterator[PartWriter]:
        return iter((self.rows, self.baseline, self.again, self.nodes))


class GenerationPasses:
    """A job's passes over its rows, and what streaming them needs."""

    def __init__(self, config: JobConfig, *, scan: InputScan, out: OutputDir,
                 schema: pa.Schema, done: Done, max_len: int, ray_data: bool,
                 text_tools: Callable, engine_factory: Callable, backend_factory: Callable,
                 lease: Lease, writers: Writers, result: JobResult,
                 on_row: Callable[[dict], None] | None):
        """``done``: what earlier runs wrote (the main pass skips those rows, the baseline
        passes run what they lack); ``ray_data``: tokenize on the cluster (else here);
        ``result``: where the passes count what they did."""
        self.config, self.scan, self.out, self.schema, self.done = config, scan, out, schema, done
        self.max_len, self.ray_data, self.text_tools = max_len, ray_data, text_tools
        self.engine_factory, self.backend_factory = engine_factory, backend_factory
        self.lease, self.writers, self.result, self.on_row = lease, writers, result, on_row
        self.pending = done.pending
        self.skip = done.rows.cast(scan.id_type)
        self.meta: dict = {}  # row id -> (num_input_tokens, truncated) of the rows in flight
        self.held: list[dict] = []  # error rows met before the engine started
        self.seen = Workload()  # of the pass's rows with a prompt streamed so far (progress)
        self.bounds: dict = {}  # a started tree's key -> its work_bound when it started
        self.hold_errors = True
        self.builder = None  # the driver's PromptBuilder, made once a pass has trees

    def tokenize_stage(self, skip: pa.Array | None = None,
                       keep: pa.Array | None = None) -> Stage:
        """The processor's tokenize stage (runtime/stages.py) with the job's prompt options;
        a pool that grows from one actor as the backlog asks: a fixed pool larger than the
        input's blocks has actors still starting when the input is done, and Ray Data fails
        the whole Dataset when such an actor is cancelled (seen on a busy machine)."""
        c = self.config
        return Stage(TokenizeStage, (self.make_builder, c.input_column, c.id_column, skip, keep),
                     rows=16, actors=(1, max(1, min(c.tokenizers, len(self.scan.files)))),
                     cpus=c.tokenizer_cpus)

    @property
    def make_builder(self) -> Callable[[], PromptBuilder]:
        """The job's PromptBuilder, made where it is called (a stage's actor, or here):
        picklable, it loads the tokenizer."""
        c = self.config
        return functools.partial(make_builder, self.text_tools, c, c.mode, c.instruction,
                                 self.max_len, c.max_new_tokens, c.truncate, c.input_column,
                                 c.tree_shape())

    def prompt_batches(self, skip: pa.Array | None = None,
                       keep: pa.Array | None = None) -> Iterator[pa.Table]:
        """The input's rows as prompt batches, streamed: tokenized by Ray Data on the
        cluster, or by the same stage here (a small input, or the job's given text tools)."""
        c = self.config
        stage = self.tokenize_stage(skip, keep)
        if self.ray_data:
            yield from stream_batches(self.scan.files, self.scan.fs,
                                      [c.id_column, c.input_column], stage,
                                      batch_rows=c.stream_rows)
            return
        tokenize = stage.here()
        for table in iter_texts(self.scan, c.stream_rows):
            out = tokenize(table)
            if out.num_rows:
                yield out

    def tasks(self, batches: Iterator[pa.Table], errors: bool) -> Iterator[Task]:
        """Tasks of the prompt batches (runtime/stages.py's batch_tasks: each batch longest
        prompt first); with ``errors`` a row's input error is written (held until
        the engine started: a failed start writes nothing). Only the rows in flight keep
        their token ids (a NumPy view of their batch) and their metadata (``self.meta``)."""
        c = self.config
        for batch in batches:
            check_terminate()
            ids = batch.column(c.id_column).to_pylist()
            lengths = batch.column("num_input_tokens").to_pylist()
            truncated = batch.column("truncated").to_pylist()
            problems = batch.column("error").to_pylist()
            chunks = (batch.column("chunk_prompts").to_pylist()
                      if "chunk_prompts" in batch.column_names else None)
            digests = chunks and batch.column("chunk_digests").to_pylist()
            for i, task in batch_tasks(batch, ids):
                if task is None:
                    if errors:
                        self.write_error(ids[i], problems[i], lengths[i])
                    continue
                if chunks is not None and chunks[i] is not None:  # a tree (jobs/trees.py)
                    task = TreeTask(task.key, (), chunks=list(zip(chunks[i], digests[i])))
                    self.seen.add(rows=1)  # its work is counted as it starts (on_tree_start)
                else:
                    self.seen.add(1, 1, lengths[i])
                self.meta[ids[i]] = (lengths[i], truncated[i])
                yield task

    def write_error(self, row_id, error: str, length) -> None:
        """A row that failed before generation (its input): finished already."""
        c = self.config
        row = result_row(c.id_column, row_id, c.strategy.name, error=error,
                         num_input_tokens=length, error_kind="input")
        if self.hold_errors:
            self.held.append(row)
            return
        if c.stop_after is None or self._written() < c.stop_after:
            self.writers.rows.add(row)
            if self.on_row:
                self.on_row(row)

    def main_pass(self) -> None:
        """The job's strategy over every pending row, as the rows stream in. The engine
        starts while Ray Data tokenizes the first rows (in-process tokenizing: once a row
        with a prompt arrived, so that a job of failed rows starts none); the rows that failed
        before are written only once it started (a failed start writes nothing, not even
        these rows, so a corrected command may start over)."""
        c = self.config
        if not self.pending:
            return
        self.seen = Workload()
        stream = self.prompt_batches(skip=self.skip)
        try:
            with contextlib.ExitStack() as stack:
                todo = self.tasks(stream, errors=True)
                engine = None
                if self.ray_data:  # the engine starts while the cluster tokenizes
                    peek = stack.enter_context(ThreadPoolExecutor(1)).submit(next, todo, None)
                    engine = self.start_engine(stack)
                    first = peek.result()
                else:
                    first = next(todo, None)  # held errors until the first row to generate
                self.hold_errors = False
                limit = c.stop_after
                if first is None or (limit is not None and len(self.held) >= limit):
                    self.write_held()  # no row to generate: no engine (or not for long)
                    self.meta.clear()
                else:
                    engine = engine or self.start_engine(stack)
                    self.write_held()
                    log.info("generating %d row(s) with %s on %d replica(s) x tp=%d",
                             self.pending - self._written(), c.strategy.name, c.replicas,
                             c.tp)
                    rows = Pass("rows", c.strategy.name, self.writers.rows, self._count_generated,
                                c.stop_after, self.on_row, reports_kv=True)
                    self.generate(engine, rows, itertools.chain([first], todo),
                                  self.pending, failed_before=self._written())
        finally:
            stream.close()
        self.result.stopped_early = self._written() < self.pending
        self.writers.rows.flush()

    def start_engine(self, stack: contextlib.ExitStack):
        """The main pass's engine, stopped when ``stack`` closes."""
        c = self.config
        engine = stack.enter_context(self.engine_factory(c, c.strategy, c.replicas))
        self.result.profile = _profile_report(engine, c.replicas)
        self.result.max_num_seqs = _max_num_seqs(engine, c)
        if c.max_num_seqs and self.result.max_num_seqs < c.max_num_seqs:
            log.warning("--max-num-seqs %d capped to %d: the fixed slots the KV cache holds "
                        "(engine/memory.py)", c.max_num_seqs, self.result.max_num_seqs)
        return engine

    def write_held(self) -> None:
        held, self.held = self.held, []
        for row in held:
            self.write_error(row[self.config.id_column], row["error"], row["num_input_tokens"])

    def _written(self) -> int:
        return self.writers.rows.written + len(self.writers.rows.buffer)

    def baseline_left(self) -> bool:
        """Whether a baseline pass has rows left to run (a complete job resumed)."""
        if self.config.strategy.name == "ar" or self.config.baseline_fraction <= 0:
            return False
        ready = baseline_ids(self.out, self.schema, self.config.baseline_fraction)
        return any(len(_missing(ready, passed)) for passed in (self.done.baseline,
                                                               self.done.again))

    def baseline_passes(self) -> None:
        """The baseline rows with the job's strategy again, then with ar, in two passes
        batched alike, for a measured speedup (the main pass decoded them among other rows,
        at another batch: its timings are not comparable with ar's)."""
        c = self.config
        check_terminate()
        if c.strategy.name != "ar" and c.baseline_fraction > 0 and not self.result.stopped_early:
            ready = baseline_ids(self.out, self.schema, c.baseline_fraction)
            for strategy, pass_writer, passed in ((c.strategy, self.writers.again,
                                                   self.done.again),
                                                  (AR, self.writers.baseline,
                                                   self.done.baseline)):
                left = _missing(ready, passed)
                if not left:
                    continue
                replicas = min(c.replicas, len(left))
                log.info("baseline: %d row(s) with %s on %d replica(s), to measure the speedup",
                         len(left), strategy.name, replicas)
                stream = self.prompt_batches(keep=left.cast(self.scan.id_type))
                self.seen = Workload()
                try:
                    again = Pass(f"baseline ({strategy.name})", strategy.name, pass_writer,
                                 self._count_baseline)
                    with self.engine_factory(c, strategy, replicas) as engine:
                        self.generate(engine, again, self.tasks(stream, False), len(left))
                finally:
                    stream.close()
                check_terminate()
        self.writers.baseline.flush()
        self.writers.again.flush()

    def trees(self, run: Pass, dispatcher: Dispatcher) -> TreeDispatch | None:
        """The pass's summary trees, with the nodes earlier runs left; None: the job makes
        none (prompt mode, --long-documents truncate or fail)."""
        c = self.config
        if c.tree_shape() is None:
            return None
        if self.builder is None:  # the driver's: combining prompts are made as nodes finish
            self.builder = self.make_builder()
        schema = self.writers.nodes.schema
        config = c.digest()
        known = read_known(self.out, schema, run.writer.sub, config)
        return tree_dispatch(self.builder, dispatcher, run.writer.sub, config,
                             self.writers.nodes, known, self.on_tree_start)

    def on_tree_start(self, tree: DocumentTree) -> None:
        """A tree's work, for the progress line: the bound until it ends (:meth:`on_tree_end`)."""
        bound = self.bounds[tree.key] = tree.work_bound(self.config.max_new_tokens)
        self.seen.add(generations=bound[0], prompt_tokens=bound[1])

    def on_tree_end(self, tree: DocumentTree) -> None:
        """A tree ended: its bound replaced by the generations and prompt tokens it took."""
        generations, prompt = self.bounds.pop(tree.key, (0, 0))
        new = [n for n in tree.nodes if n.result is not None and not n.reused]
        self.seen.add(generations=len(new) - generations,
                      prompt_tokens=sum(n.result.stats.prompt_tokens for n in new) - prompt)

    def _count_generated(self) -> None:
        self.result.generated += 1

    def _count_baseline(self) -> None:
        self.result.baseline_generated += 1

    def generate(self, engine, run: Pass, todo: Iterator[Task], total: int,
                 failed_before: int = 0) -> None:
        """Generate ``todo`` (``total`` rows, ``failed_before`` of them written already as
        input errors; until ``run.stop_after`` rows were written by this run) and hand every
        row to the pass's writer; counts go to the result as they happen (so they are right
        even when the run is interrupted)."""
        c, result = self.config, self.result
        writer, label, stop_after = run.writer, run.label, run.stop_after
        seqs = _max_num_seqs(engine, c)
        inflight = c.max_inflight or seqs + 2
        backend = self.backend_factory(engine)
        dispatcher = Dispatcher(backend, c.generation_config(), max_inflight=inflight,
                                max_attempts=c.max_attempts, row_timeout=c.row_timeout)
        kv_report = getattr(backend, "kv_report", None)
        progress = Progress(total, c.progress_seconds, label, c.progress_bar,
                            max_new_tokens=c.max_new_tokens,
                            live=getattr(backend, "work", None),
                            slots=seqs * engine.num_replicas, replicas=engine.num_replicas,
                            memory=kv_report)
        errors_before = writer.errors
        trees = self.trees(run, dispatcher)
        if run.strategy == c.strategy.name:  # what the job's summary describes, in each part
            facts = {"max_num_seqs": seqs,
                     "profile": _profile_report(engine, engine.num_replicas)}
            writer.record = lambda: {**facts, **({"kv_cache": progress.kv.to_dict()}
                                                 if run.reports_kv and progress.kv else {})}

        def on_result(outcome: Outcome) -> None:
            if isinstance(outcome.task, NodeTask):
                progress.add_tokens(outcome)
                tree = trees.landed(outcome)
                if tree is not None:
                    on_tree(tree, outcome.task)
                return
            length, truncated = self.meta.pop(outcome.task.key)
            if outcome.error is not None:  # a generation that failed: not one to wait for
                self.seen.add(generations=-1)
            row = {**result_row(c.id_column, outcome.task.key, run.strategy,
                                num_input_tokens=length, truncated=truncated),
                   **outcome_columns(outcome)}
            add(row, outcome)

        def on_tree(tree: DocumentTree, task: Task) -> None:
            """A tree ended: its row, the final summary with the tree's sums (or its error)."""
            self.on_tree_end(tree)
            length, _ = self.meta.pop(tree.key)
            result, columns = tree_row(tree)
            outcome = Outcome(task, result=result, error=tree.error,
                              replica=None if result is None else result.replica,
                              kind=tree.error_kind)
            row = {**result_row(c.id_column, tree.key, run.strategy),
                   **outcome_columns(outcome), **columns,
                   "num_input_tokens": length,  # the document's prompt, not the tree's sum
                   "attempts": sum(n.result is not None and not n.reused for n in tree.nodes)}
            add(row, Outcome(task, error=tree.error))

        def add(row: dict, outcome: Outcome) -> None:
            if row["error"] is None:
                run.count()
            writer.add(row)
            progress.update(outcome)
            if run.on_row is not None:
                run.on_row(row)

        if trees is not None:
            todo = trees.expand(todo, on_tree)

        def on_tick() -> None:
            check_terminate()
            self.lease.check()
            writer.maybe_flush()
            self.writers.nodes.maybe_flush()
            # rows that failed on input are written, not generated: done, and failed
            progress.skipped = failed_before + writer.errors - errors_before - progress.failed
            if self.seen.rows:  # the pass's work, estimated from the rows streamed so far
                progress.generations_total, progress.prompt_tokens = self.seen.expected(
                    progress.total - progress.skipped)
            progress.tick()

        def should_stop(count: int) -> bool:  # rows written and in flight (a tree's once)
            started = {f.task.row for f in dispatcher.inflight.values()}
            started |= {t.row for t in dispatcher.front if isinstance(t, NodeTask)}
            return self._written() + len(started) >= stop_after

        try:
            dispatcher.run(todo, on_result, on_tick, None if stop_after is None else should_stop,
                           lookahead=c.stream_rows)
        finally:
            self.writers.nodes.flush()
            writer.flush()  # before the engine shuts down: a SIGKILL may follow a SIGTERM soon
            progress.close()
            if run.reports_kv and progress.kv is not None:  # as of the last progress line
                result.kv_cache = progress.kv.to_dict()
            result.replica_restarts += dispatcher.restarts
            result.replicas_lost += dispatcher.lost
            result.row_retries += dispatcher.retried_rows
            if dispatcher.restarts:
                log.warning("%s: %d replica restart(s), %d row retry(ies)", label,
                            dispatcher.restarts, dispatcher.retried_rows)



def _max_num_seqs(engine, config: JobConfig) -> int:
    """Rows one replica decodes at once: what the replicas reported (the asked number, or
    less where memory capped it), else as asked."""
    info = getattr(engine, "replica_info", None)
    seqs = info(0).max_num_seqs if info is not None else None
    return seqs or config.max_num_seqs or 1


def _profile_report(engine, replicas: int) -> dict | None:
    """Which latency profile priced this run: key, path and origin ("loaded" from a stored
    file, "measured" now and kept at path, "given"); per replica when they differ."""
    info = getattr(engine, "replica_info", None)
    if info is None:
        return None
    reports = [info(i).profile for i in range(replicas)]
    reports = [r for r in reports if r]
    if not reports:
        return None
    return reports[0] if all(r == reports[0] for r in reports) else {"replicas": reports}
