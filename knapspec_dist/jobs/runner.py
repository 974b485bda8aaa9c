"""One batch job, start to end: check input, resume, generate, baseline, summary.

Order matters for users: everything that can be checked without a model (options, the
input files, the output directory) is checked first, so a malformed job fails in seconds
with one clear line; the tokenizer and config (small files) come next, to turn rows into
prompts and fail bad rows; then the job takes the output directory's lease (jobs/lease.py:
one job per output; a second one is refused before it writes anything) and reads the rows
written already; only then does the RayEngine start its actors and load weights, and only
when there is a row left to generate.

The stages are the methods of :class:`JobRun`, in the order :meth:`JobRun.run` calls them;
the passes over the rows are a :class:`~knapspec_dist.jobs.passes.GenerationPasses` it makes
once the checks are done and the output is open.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import time
from typing import Callable

import pyarrow as pa

from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.errors import UserError, first_line
from knapspec_dist.jobs.inputs import InputScan, legacy_digest, read_input
from knapspec_dist.jobs.lease import Lease
from knapspec_dist.jobs.options import JobConfig
from knapspec_dist.jobs.output import (
    BASELINE,
    BASELINE_STRATEGY,
    NODES,
    PLOT_FILE,
    ROWS,
    SUMMARY_FILE,
    OutputDir,
    PartWriter,
    output_schema,
)
from knapspec_dist.jobs.passes import GenerationPasses, Writers
from knapspec_dist.jobs.plot import PLOT_COLUMNS, write_plot
from knapspec_dist.jobs.result import JobResult
from knapspec_dist.jobs.resume import read_done
from knapspec_dist.jobs.summary import COLUMNS, dumps, summarize
from knapspec_dist.jobs.termination import (
    JobTerminated,
    check_terminate,
    install_sigterm,
    restore_sigterm,
)
from knapspec_dist.jobs.trees import node_schema
from knapspec_dist.runtime.backend import EngineBackend
from knapspec_dist.runtime.cluster import connect, disconnect
from knapspec_dist.runtime.messages import ReplicaBudget
from knapspec_dist.runtime.prompts import PromptBuilder, load_text_tools
from knapspec_dist.runtime.ray_engine import RayEngine
from knapspec_dist.runtime.setup import check_kv_memory, check_setup
from knapspec_dist.speculation.options import StrategyOptions

__all__ = ["JobResult", "JobRun", "JobTerminated", "default_engine_factory", "load_text_tools",
           "run_job"]

log = logging.getLogger(__name__)

#: Inputs of at most this many rows are tokenized in the driver (streamed all the same, a
#: batch at a time): Ray Data's tokenizer actors take seconds to start (they import torch).
LOCAL_ROWS = 1000


def default_engine_factory(config: JobConfig, strategy: StrategyOptions, replicas: int,
                           longest: int | None = None) -> RayEngine:
    """Start the Ray engine (actors, placement groups, weights).  ``longest``: the longest
    row of the job (prompt + new tokens), which its latency profile must cover and its KV
    cache hold."""
    return RayEngine(config.model, tp=config.tp, replicas=replicas, strategy=strategy,
                  dtype=config.dtype, device=config.device, address=config.address,
                  cpus_per_rank=config.cpus_per_rank, profile_need=longest,
                  max_num_seqs=config.max_num_seqs, max_model_len=longest,
                  kv_cache_memory=config.kv_cache_memory,
                  memory_utilization=config.memory_utilization)


def run_job(config: JobConfig, *, engine_factory: Callable | None = None,
            backend_factory: Callable | None = None, text_tools: Callable | None = None,
            on_row: Callable[[dict], None] | None = None) -> JobResult:
    """Run one job; returns where its results are and its summary.

    ``engine_factory(config, strategy, replicas)`` returns a context-managed engine for
    ``strategy`` (StrategyOptions; default: :class:`knapspec_dist.runtime.ray_engine.RayEngine`);
    ``backend_factory(engine)`` adapts it to the dispatcher (default
    :class:`knapspec_dist.runtime.backend.EngineBackend`); ``text_tools(config)`` gives the
    tokenizer and context window (default :func:`load_text_tools`).  ``on_row(row)`` sees
    every output row right after it was queued for writing (tests use it to inject faults).
    Raises :class:`UserError` for bad options, input or output directory.
    """
    return JobRun(config, engine_factory, backend_factory, text_tools, on_row).run()


class JobRun:
    """One run of a job: its checks, lease, resume and summary, around its passes."""

    def __init__(self, config: JobConfig, engine_factory: Callable | None,
                 backend_factory: Callable | None, text_tools: Callable | None,
                 on_row: Callable[[dict], None] | None):
        self.config = config
        self.real_engine = engine_factory is None  # one Ray connection for all its engines
        self.engine_factory = engine_factory or default_engine_factory
        self.backend_factory = backend_factory or EngineBackend
        # Prompts are tokenized on the cluster with Ray Data (runtime/stream.py) unless the
        # input is small (check_output): then the tokenizer actors' start would cost more
        # than they save. Whoever the tokenizer is, the rule is the same.
        self.ray_data = False
        self.text_tools = text_tools or load_text_tools
        self.on_row = on_row
        self.started = dt.datetime.now(dt.timezone.utc)
        self.t_start = time.monotonic()

    def run(self) -> JobResult:
        self.check_output()
        self.check_prompts()
        self.lease = Lease(self.out)
        self.lease.acquire()  # LeaseHeld (a UserError) when another job writes there
        try:
            self.open_output()
            self.open_writers()
            self.passes = GenerationPasses(
                self.config, scan=self.scan, out=self.out, schema=self.schema, done=self.done,
                max_len=self.max_len, ray_data=self.ray_data, text_tools=self.text_tools,
                engine_factory=self.engine_factory, backend_factory=self.backend_factory,
                lease=self.lease, writers=self.writers, result=self.result,
                on_row=self.on_row)
            self.generate_all()
            return self.write_summary()
        finally:
            self.lease.release()
            self.out.remove_if_unused()

    def generate_all(self) -> None:
        previous = install_sigterm()
        owns_ray = False
        passes = self.passes
        try:
            if (self.real_engine or self.ray_data) and (self.pending or passes.baseline_left()):
                owns_ray = connect(self.config.address)
                install_sigterm()  # ray.init() put its own SIGTERM handler (an abort) in place
            check_terminate()
            passes.main_pass()
            passes.baseline_passes()
        finally:
            for w in self.writers:
                try:
                    w.flush()
                except Exception:  # noqa: BLE001 - keep the original error
                    log.exception("could not write the last part of %s", w.sub)
            restore_sigterm(previous)
            if owns_ray:
                disconnect()

    # ------------------------------------------------------------------ 1. files

    def check_output(self) -> None:
        """Input and output directory, before any model is touched, reading only: the input
        files' footers and ids, and whether the directory is new, empty or this job's."""
        c = self.config
        self.scan: InputScan = read_input(c.input, c.id_column, c.input_column)
        self.out = OutputDir(c.output)
        self.fingerprint = {**c.fingerprint(), **self.scan.fingerprint(c.input)}
        self.legacy = functools.cache(lambda: legacy_digest(self.scan))  # old outputs
        # --retry-failed: another job's output whose rows all failed is taken over
        self.resuming = self.out.check(self.fingerprint, self.legacy, c.retry_failed)
        self.schema = output_schema(c.id_column, self.scan.id_type)
        self.ray_data = len(self.scan) > LOCAL_ROWS

    def open_output(self) -> None:
        """Under the lease: the ids an earlier run of this job wrote already (one row per
        id), less the failed rows to retry (a retryable kind, or all with --retry-failed).
        The rows left are an anti-join of the input's ids with those (Arrow, no row object)."""
        c = self.config
        self.resuming = self.out.check(self.fingerprint, self.legacy,  # nobody wrote since
                                       c.retry_failed)
        if self.out.take_over is not None:  # another job's failed rows: out of the way
            self.out.set_aside()
        if self.out.migrated:
            self.out.commit_job()  # job.json with the new definition of input_sha256
        # a summary of the job taken over describes none of this job's passes
        self.previous = {} if self.out.take_over is not None else self._previous_summary()
        self.done = read_done(self.out, self.schema, self.scan.ids, c.retry_failed)
        self.pending = self.done.pending
        if self.done.retry:
            log.info("retrying %d failed row(s) (%s)", self.done.retry,
                     "--retry-failed" if c.retry_failed
                     else "out of memory, a lost or hung replica")
        if self.resuming:
            log.info("resuming into %s: %d of %d rows already written, %d to go",
                     self.out.display(), self.done.in_input, len(self.scan), self.pending)
            if self.done.not_in_input:
                log.warning("%d row(s) in the output have ids that are not in the input",
                            self.done.not_in_input)

    # ------------------------------------------------------------------ 2. rows

    def check_prompts(self) -> None:
        """The tokenizer and context window (small files), checked against the options
        before anything else: a text job's chat template, and a tree's shape (chunk, overlap,
        two summaries a group) against the window, so that no option fails every long row
        (runtime/prompts.py ``tree_chunk_tokens``). The rows are tokenized later, as they
        stream (see jobs/passes.py ``prompt_batches``)."""
        c = self.config
        tokenizer, window = self.text_tools(c)
        self.max_len = window if c.max_model_len is None else c.max_model_len
        if self.max_len > window:
            raise UserError(f"--max-model-len {self.max_len} exceeds the model's context "
                            f"window {window}")
        if c.max_new_tokens >= self.max_len:
            raise UserError(f"--max-new-tokens {c.max_new_tokens} leaves no room for a prompt "
                            f"in the context window of {self.max_len} tokens")
        PromptBuilder(tokenizer, c.mode, c.instruction, self.max_len, c.max_new_tokens,
                      c.truncate, c.input_column, c.tree_shape())
        if self.real_engine:  # the profile must cover any context this job may run
            self.engine_factory = lambda config, strategy, replicas: default_engine_factory(
                config, strategy, replicas, longest=self.max_len)
            if c.kv_cache_memory is not None:  # a budget too small for one row: before Ray
                _, model_config = check_setup(c.model, c.tp, c.strategy)
                check_kv_memory(model_config, c.tp, c.dtype, c.device, ReplicaBudget(
                    row_capacity(self.max_len, 0), c.max_num_seqs, c.kv_cache_memory,
                    c.memory_utilization, self.max_len), None)

    def open_writers(self) -> None:
        """Part writers of the rows and of the two baseline passes, knowing what is done."""
        c = self.config

        def writer(sub: str) -> PartWriter:  # the earlier runs' ids are not streamed again
            return PartWriter(self.out, sub, self.schema, (), c.checkpoint_rows,
                              c.checkpoint_seconds)

        self.writers = Writers(*(writer(sub) for sub in (ROWS, BASELINE, BASELINE_STRATEGY)),
                               PartWriter(self.out, NODES, node_schema(c.id_column,
                                                                       self.scan.id_type),
                                          (), c.checkpoint_rows, c.checkpoint_seconds))
        self.result = JobResult(output=self.out.display(), rows_path=self.out.display(ROWS),
                                summary_path=self.out.display(SUMMARY_FILE),
                                plot_path=self.out.display(PLOT_FILE), summary={},
                                skipped=len(self.scan) - self.pending)

    # ------------------------------------------------------------------ 4. summary

    def write_summary(self) -> JobResult:
        """summary.json and speedup.png; one that cannot be written (a full disk, a figure
        JSON cannot hold) is an error that keeps every row written: the same job, run
        again, writes them."""
        try:
            return self._write_summary()
        except (OSError, ValueError, UserError) as e:
            log.debug("writing %s failed", SUMMARY_FILE, exc_info=True)
            raise UserError(f"{self.out.display(SUMMARY_FILE)} could not be written "
                            f"({first_line(e)}); the rows written are kept in "
                            f"{self.out.display()}: run the same job again to write "
                            "it") from None

    def carry_forward(self) -> None:
        """The engine facts of a pass that ran no engine now (a resumed job with nothing
        left to generate): what the newest part of an earlier main pass recorded, else the
        job's strategy in a baseline pass, else the earlier summary; so that every field
        of the summary describes the whole job."""
        result, previous = self.result, self.previous
        earlier = {"max_num_seqs": (previous.get("throughput") or {}).get("max_num_seqs")
                   or (previous.get("run") or {}).get("max_num_seqs"),
                   "profile": (previous.get("run") or {}).get("profile"),
                   "kv_cache": previous.get("kv_cache")}
        sources = (self.out.last_record(ROWS), self.out.last_record(BASELINE_STRATEGY), earlier)
        for name in ("max_num_seqs", "profile", "kv_cache"):
            if getattr(result, name) is None:
                setattr(result, name, next((s[name] for s in sources
                                            if s.get(name) is not None), None))

    def _write_summary(self) -> JobResult:
        """summary.json and speedup.png over everything in the output directory: the main
        pass's parts streamed, a few columns each (jobs/summary.py); the baseline passes'
        rows (a small fraction) read whole."""
        c, result = self.config, self.result
        tables: dict[str, pa.Table] = {sub: self.out.read_rows(sub, self.schema)
                                       for sub in (BASELINE, BASELINE_STRATEGY)}
        self.carry_forward()
        reproducible, why = c.reproducible()
        job = {"model": c.model, "strategy": c.strategy.name, "tp": c.tp,
               "replicas": c.replicas, "dtype": c.dtype, "device": c.device,
               "guarantee": c.guarantee(), "reproducible": reproducible,
               **({"reproducible_note": why} if why else {}),
               "max_new_tokens": c.max_new_tokens, "temperature": c.temperature,
               "sampling": c.sampling,
               "input": c.input, "output": result.output, "input_files": len(self.scan.files),
               "max_model_len": self.max_len, "truncate": c.truncate,
               "long_documents": c.long_documents,
               "baseline_fraction": c.baseline_fraction}
        run = {"started_at": self.started.isoformat(timespec="seconds"),
               "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "wall_s": time.monotonic() - self.t_start, "resumed": self.resuming,
               "rows_skipped": result.skipped, "rows_written": self.writers.rows.written,
               "rows_generated": result.generated, "baseline_rows_generated":
               result.baseline_generated, "stopped_early": result.stopped_early,
               "replica_restarts": result.replica_restarts,
               "replicas_lost": result.replicas_lost, "row_retries": result.row_retries,
               "profile": result.profile, "max_num_seqs": result.max_num_seqs}
        parts = self.out.iter_rows(ROWS, self.schema, [c.id_column, *COLUMNS])
        summary = summarize(parts, tables[BASELINE], c.id_column, self.scan.ids, job, run,
                            again=tables[BASELINE_STRATEGY], kv_cache=result.kv_cache)
        self.out.write_bytes(SUMMARY_FILE, dumps(summary))
        points = self.out.read_rows(ROWS, self.schema, [c.id_column, *PLOT_COLUMNS])
        write_plot(summary, points, tables[BASELINE], c.id_column,
                   lambda data: self.out.write_bytes(PLOT_FILE, data),
                   again=tables[BASELINE_STRATEGY])
        result.summary = summary
        return result

    def _previous_summary(self) -> dict:
        """The summary.json of an earlier run (empty when none or unreadable)."""
        try:
            with self.out.fs.open_input_stream(self.out.join(SUMMARY_FILE)) as f:
                data = json.loads(f.read().decode())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError, UnicodeDecodeError):
            return {}


