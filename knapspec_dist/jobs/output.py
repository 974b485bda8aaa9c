"""Output directory: Parquet part files written atomically, checkpoint by id, resume.

Layout of ``--output DIR`` (a local path or a pyarrow filesystem URI)::

    DIR/job.json          what decides the rows' output, the input included (checked when a
                          job resumes; written with the first part file: rows, or a
                          book's first tree nodes)
    DIR/rows/part-*.parquet       one row per input row, in the order rows finished
    DIR/baseline/part-*.parquet   the baseline rows, run again with ``ar``
    DIR/baseline_strategy/part-*.parquet   the same rows run again with the job's strategy,
                          right before ``ar`` and batched alike: the speedup's numerator
    DIR/summary.json, DIR/speedup.png

Read the results with ``pyarrow.parquet.read_table("DIR/rows")``,
``pandas.read_parquet("DIR/rows")`` or ``ray.data.read_parquet("DIR/rows")``.

Exactly once: a part is written under a hidden temporary name and renamed into place, so a
reader (or a resumed job) sees all of its rows or none; a row is only ever added to a part
after it finished, and a resumed job skips every id found in the parts.  A crash loses at
most the finished rows not yet flushed (``--checkpoint-rows`` / ``--checkpoint-seconds``),
which the next run computes again.  Leftover temporary files are removed on resume; a part
that cannot be read (a filesystem without atomic renames, a disk error) is moved aside to a
hidden ``.corrupt-`` name and its rows are computed again.

One job at a time per directory: the job holds ``DIR/.lease.json`` (jobs/lease.py) while it
runs.  Another job's output is refused, unless none of its rows succeeded and the job runs
with ``--retry-failed``: then the job takes it over (:meth:`OutputDir.check`,
:meth:`OutputDir.set_aside`), so options that failed every row never lock their output.

Exactly once on read too: should an id appear in more than one row (a part file copied by
hand, a rerun that retried a failed row), :meth:`OutputDir.read_rows` keeps one row per id
(see :func:`keep_one_per_id`) and warns with the count it dropped.

Error kinds (``error_kind``): ``input`` (the row's text or prompt), ``row`` (its generation
failed), and the retryable ``oom``, ``replica`` (its replica failed ``--max-attempts`` times)
and ``timeout``: a rerun retries the rows that failed for a retryable reason, and
``--retry-failed`` every failed row.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from knapspec_dist.errors import UserError, first_line
from knapspec_dist.jobs.inputs import filesystem_and_path
from knapspec_dist.jobs.parts import iter_parts, last_record
from knapspec_dist.jobs.summary import finite
from knapspec_dist.runtime.stages import RESULT_FIELDS, TREE_FIELDS, result_columns

log = logging.getLogger(__name__)

ROWS = "rows"
BASELINE = "baseline"
BASELINE_STRATEGY = "baseline_strategy"
NODES = "nodes"  # the summary trees' nodes (jobs/trees.py)
SUBDIRS = (ROWS, BASELINE, BASELINE_STRATEGY, NODES)
JOB_FILE = "job.json"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "speedup.png"
RETRYABLE = ("oom", "replica", "timeout")  # error kinds a rerun retries
#: A part's schema metadata key: the engine its rows ran on (jobs/passes.py's record), so a
#: resumed job's summary describes the passes of earlier runs too.
RUN_RECORD = b"knapspec.run"


#: Columns a job's output adds to the engine's (``RESULT_FIELDS``).
JOB_FIELDS = [
    ("strategy", pa.string()),
    ("truncated", pa.bool_()),  # the prompt was cut to fit --max-model-len
    *TREE_FIELDS,
    ("finished_at", pa.timestamp("us", tz="UTC")),  # when the row was written
]


def output_schema(id_column: str, id_type: pa.DataType) -> pa.Schema:
    """One output row per input row: its id first, the engine's columns (Ray Data LLM's names
    where they overlap), then the job's."""
    return pa.schema([pa.field(id_column, id_type, nullable=False), *RESULT_FIELDS,
                      *JOB_FIELDS])


def is_retryable(row: dict) -> bool:
    """Whether a failed row failed for a reason a rerun may not meet again (out of memory, a
    lost or hung replica).  Rows written before ``error_kind`` existed: by their message."""
    if row.get("error") is None:
        return False
    kind = row.get("error_kind")
    if kind is not None:
        return kind in RETRYABLE
    message = row["error"]
    return (message.startswith("replica failed ") or "OutOfMemoryError" in message
            or message.startswith("MemoryError"))


def result_row(id_column: str, row_id, strategy: str, result=None, *, error: str | None = None,
               num_input_tokens: int | None = None, truncated: bool = False,
               replica: int | None = None, attempts: int = 0,
               error_kind: str | None = None) -> dict:
    """An output row from a GenerationResult (success) or an error message (of the kind
    ``error_kind``: default ``row``)."""
    row = {name: None for name in output_schema(id_column, pa.string()).names}
    row.update({id_column: row_id, "strategy": strategy, "truncated": truncated,
                "replica": replica, "attempts": attempts, "error": error,
                "error_kind": None if error is None else (error_kind or "row"),
                "num_input_tokens": num_input_tokens,
                "document_path": None if error_kind == "input" else
                ("truncated" if truncated else "whole"),
                "finished_at": dt.datetime.now(dt.timezone.utc)})
    if result is not None and error is None:
        row.update(result_columns(result))
    return row


class OutputDir:
    """The job's output directory on its filesystem."""

    def __init__(self, uri_or_path: str):
        self.uri = uri_or_path
        self.fs, self.path = filesystem_and_path(uri_or_path)
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self._job: bytes | None = None  # job.json, until the first rows are written
        self.created = False  # the directory was created by this job (create)
        self._warned: set[str] = set()  # subdirectories whose duplicates were reported
        self.migrated = False  # job.json of an earlier version, to rewrite (check)
        # what differs from another job whose output, every row failed, this one takes over
        # (check with take_over); its parts are set aside under the lease (set_aside)
        self.take_over: str | None = None

    def join(self, *parts: str) -> str:
        return "/".join([self.path.rstrip("/"), *parts])

    def display(self, *parts: str) -> str:
        """A location users can paste: a local path, or the URI."""
        if self.local:
            return os.path.join(self.path, *parts)
        return "/".join([self.uri.rstrip("/"), *parts])

    def prepare(self, fingerprint: dict) -> bool:
        """:meth:`check`, then :meth:`create`. True when resuming."""
        resuming = self.check(fingerprint)
        self.create()
        return resuming

    def check(self, fingerprint: dict, legacy_input: Callable[[], str] | None = None,
              take_over: bool = False) -> bool:
        """Check, reading only, that the directory is new, empty or this job's: True when
        resuming (rows of this job are there).

        ``job.json`` is not written here but with the job's first rows (:meth:`commit_job`):
        a job that failed before writing a row leaves no identity behind, so the corrected
        command may start over in the same directory with other options.  A directory whose
        ``job.json`` names another job is refused only when it holds rows; then nothing in
        it is touched.  With ``take_over`` (``--retry-failed``) such a directory whose rows
        all failed is this job's to take over instead: :attr:`take_over` says how the jobs
        differ, and :meth:`set_aside` (under the lease) moves the other job's parts out of
        the way."""
        self.take_over = None
        info = self._call(lambda: self.fs.get_file_info(self.path))
        if info.type == pafs.FileType.File:
            raise UserError(f"--output {self.uri!r} is a file, not a directory")
        job_file = self.join(JOB_FILE)
        existing = None
        has_rows = False
        if info.type == pafs.FileType.Directory:
            has_rows = self._call(self.has_rows)
            if self.fs.get_file_info(job_file).type == pafs.FileType.File:
                with self.fs.open_input_stream(job_file) as f:
                    existing = json.loads(f.read().decode())
            elif [i for i in self.fs.get_file_info(pafs.FileSelector(self.path))
                  if not os.path.basename(i.path).startswith((".", "_"))
                  and os.path.basename(i.path) not in SUBDIRS] or has_rows:
                raise UserError(f"--output {self.uri!r} holds files but no {JOB_FILE}: not a "
                                "knapspec job's output; choose an empty or new folder")
        # strict JSON: a job.json with a nan could never be resumed (nan != nan)
        self._job = json.dumps({"fingerprint": fingerprint, "created": _now_iso()},
                               indent=2, allow_nan=False).encode() + b"\n"
        if existing is not None and has_rows:
            before = existing.get("fingerprint", {})
            differ = sorted(k for k in set(before) | set(fingerprint)
                            if before.get(k) != fingerprint.get(k))
            if differ == ["input_sha256"] and legacy_input is not None:
                if legacy_input() == before["input_sha256"]:
                    if not self.migrated:
                        log.warning("%s was written by an earlier version, which hashed the "
                                    "input from its texts: the same input by that hash; "
                                    "%s now records the new hash", self.uri, JOB_FILE)
                    self.migrated = True
                    return True
                return self._other_job(
                    "a different input: the same path and row count, but its ids or texts "
                    f"changed (input_sha256 {before['input_sha256']!r}, of every text as "
                    "written by an earlier version, differs from this input's)",
                    "resume with the input it was written from or choose a new --output",
                    take_over)
            if differ:
                details = "; ".join(f"{k}: {before.get(k)!r} -> {fingerprint.get(k)!r}"
                                    for k in differ)
                return self._other_job(f"a different job ({details})", "resume with the same "
                                       "options or choose a new --output", take_over)
            self._job = None  # job.json is this job's already
            return True
        if existing is not None:
            log.info("%s holds no rows yet: starting over with this job's options", self.uri)
        return False

    def _other_job(self, other: str, advice: str, take_over: bool) -> bool:
        """Another job's output (``other`` says how it differs): refused with one line that
        ends with ``advice``, nothing in it touched, when a row of it succeeded (nothing that
        succeeded is ever lost or mixed with this job's rows) or without ``take_over``; else
        this job takes it over (:attr:`take_over`): False, nothing is resumed. Its tree nodes
        do not decide: a node is reused only under the configuration that made it."""
        what = f"--output {self.uri!r} holds rows of {other}"
        if self._succeeded():
            raise UserError(f"{what}; {advice} (--retry-failed takes over an output only "
                            "when every row it holds failed, and rows of this one succeeded)")
        if not take_over:
            raise UserError(f"{what}; every row it holds failed: --retry-failed takes it over "
                            f"with this job's options, else {advice}")
        self.take_over = other
        return False

    def _succeeded(self) -> bool:
        """Whether a visible part of the rows or of a baseline pass holds a row without an
        error (reading only their ``error`` column); a part that cannot be read counts as
        one that may (its rows are not known to have failed)."""
        for sub in (ROWS, BASELINE, BASELINE_STRATEGY):
            for path in self._visible_parts(sub):
                try:
                    with self.fs.open_input_file(path) as f:
                        errors = pq.ParquetFile(f).read(columns=["error"]).column("error")
                except (pa.ArrowInvalid, pa.ArrowIOError, OSError, KeyError):
                    return True
                if errors.null_count:
                    return True
        return False

    def _visible_parts(self, sub: str) -> list[str]:
        """The part files of ``DIR/sub`` a reader sees (no hidden or temporary name)."""
        infos = self._call(lambda: self.fs.get_file_info(
            pafs.FileSelector(self.join(sub), allow_not_found=True)))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File
                      and i.path.endswith(".parquet")
                      and not os.path.basename(i.path).startswith((".", "_")))

    def set_aside(self) -> int:
        """Take over another job's output whose rows all failed (:meth:`check` with
        ``take_over``), under the lease: every part of it (failed rows, baseline rows, tree
        nodes) renamed to a hidden ``.superseded-`` name in its folder, kept for a reader
        but never read, so every input row runs again with this job's options and
        ``job.json`` names this job from its first part on. Parts first, job.json last: a
        run stopped in between leaves an output that holds no rows yet. Returns the parts
        set aside."""
        moved = 0
        for sub in SUBDIRS:
            for path in self._visible_parts(sub):
                aside = f"{self.join(sub)}/.superseded-{os.path.basename(path)}"
                self._call(lambda path=path, aside=aside: self.fs.move(path, aside))
                moved += 1
        log.warning("--output %s held only failed rows of another job (%s): --retry-failed "
                    "takes it over; its %d part file(s) are set aside as .superseded-*, every "
                    "row runs with this job's options, and %s records them with the first "
                    "part written", self.display(), self.take_over, moved, JOB_FILE)
        return moved

    def create(self) -> None:
        """Create the directory (not its subdirectories: they come with the first rows, so a
        failed start leaves no empty folders); remembers whether it was created here."""
        info = self._call(lambda: self.fs.get_file_info(self.path))
        if info.type == pafs.FileType.File:
            raise UserError(f"--output {self.uri!r} is a file, not a directory")
        if info.type == pafs.FileType.NotFound:
            self._call(lambda: self.fs.create_dir(self.path, recursive=True))
            self.created = True

    def remove_if_unused(self) -> None:
        """Remove the directory this job created when nothing was written into it (a failed
        start leaves nothing behind). Local directories only."""
        if self.created and self._job is not None and self.local:
            try:
                os.rmdir(self.path)  # only when empty
            except OSError:
                pass

    def has_rows(self) -> bool:
        """Whether any part file of a job is there (rows or baseline)."""
        for sub in SUBDIRS:
            infos = self.fs.get_file_info(pafs.FileSelector(self.join(sub), allow_not_found=True))
            if any(i.type == pafs.FileType.File and i.path.endswith(".parquet")
                   and not os.path.basename(i.path).startswith((".", "_")) for i in infos):
                return True
        return False

    def commit_job(self) -> None:
        """Write ``job.json`` before the job's first part file, of rows or tree nodes (once)."""
        if self._job is not None:
            data = self._job
            for sub in SUBDIRS:
                self._call(lambda sub=sub: self.fs.create_dir(self.join(sub), recursive=True))
            self.write_bytes(JOB_FILE, data)
            self._job = None

    def call(self, fn):
        """A filesystem call; OSError (no permission, a file in the path, ...) -> UserError."""
        return self._call(fn)

    def _call(self, fn):
        """A filesystem call; OSError (no permission, a file in the path, ...) -> UserError."""
        try:
            return fn()
        except OSError as e:
            raise UserError(f"--output {self.uri!r}: cannot write there: "
                            f"{e.strerror or first_line(e)}") from None

    def write_bytes(self, name: str, data: bytes) -> str:
        """Write ``DIR/name`` atomically (temporary file, then rename)."""
        return self._call(lambda: self._write_bytes(name, data))

    def _write_bytes(self, name: str, data: bytes) -> str:
        final = self.join(name)
        head, tail = final.rsplit("/", 1)
        tmp = f"{head}/.{tail}.{uuid.uuid4().hex[:8]}.tmp"
        if self.fs.get_file_info(head).type == pafs.FileType.NotFound:
            self.fs.create_dir(head, recursive=True)
        if self.local:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        else:
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            self.fs.move(tmp, final)
        return final

    def read_rows(self, sub: str, schema: pa.Schema,
                  columns: list[str] | None = None) -> pa.Table:
        """Every readable part of ``DIR/sub`` as one table (empty when none): the parts of
        :meth:`iter_rows` concatenated."""
        tables = list(self.iter_rows(sub, schema, columns))
        if columns is not None:
            wanted = set(columns) | {schema.names[0], "error", "finished_at"}
            schema = pa.schema([f for f in schema if f.name in wanted])
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def last_record(self, sub: str) -> dict:
        """What the newest part of ``DIR/sub`` recorded of its engine (empty: none did)."""
        return last_record(self, sub, RUN_RECORD)

    def iter_rows(self, sub: str, schema: pa.Schema,
                  columns: list[str] | None = None) -> Iterator[pa.Table]:
        """The readable parts of ``DIR/sub``, one table a part, one row per id across them
        (jobs/parts.py); ``columns``: read only those (and what choosing one row per id
        needs), e.g. the ids and errors of a resume, not every generated text."""
        return iter_parts(self, sub, schema, columns)


class PartWriter:
    """Buffers finished rows and writes them as atomic part files under ``DIR/sub``."""

    def __init__(self, out: OutputDir, sub: str, schema: pa.Schema, done_ids=(),
                 flush_rows: int = 64, flush_seconds: float = 10.0):
        self.out, self.sub, self.schema = out, sub, schema
        self.id_column = schema.names[0]
        # ids written by this writer (and ``done_ids``): the check that no id is written twice.
        # A job passes none of its earlier runs' ids: its stream left them out already (an
        # anti-join), so this holds the ids of one run, not of the whole output.
        self.done = set(done_ids)
        self.errors = 0  # rows added with an error
        self.buffer: list[dict] = []
        self.flush_rows, self.flush_seconds = flush_rows, flush_seconds
        self.first_buffered: float | None = None
        self.run = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + \
            f"-{uuid.uuid4().hex[:6]}"
        self.parts = 0
        self.written = 0  # rows written by this writer
        # what each part records of the engine its rows ran on (RUN_RECORD); None: nothing
        self.record: Callable[[], dict] | None = None

    def add(self, row: dict) -> None:
        row_id = row[self.id_column]
        if row_id in self.done:  # never two output rows for one id
            raise RuntimeError(f"row {row_id!r} finished twice (bug in the scheduler)")
        self.done.add(row_id)
        if row["error"] is not None:
            self.errors += 1
        self.buffer.append(row)
        if self.first_buffered is None:
            self.first_buffered = time.monotonic()
        self.maybe_flush()

    def maybe_flush(self) -> None:
        if not self.buffer:
            return
        if (len(self.buffer) >= self.flush_rows
                or time.monotonic() - self.first_buffered >= self.flush_seconds):
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        table = pa.Table.from_pylist(self.buffer, schema=self.schema)
        if self.record is not None:
            record = json.dumps(finite(self.record()), allow_nan=False).encode()
            table = table.replace_schema_metadata({RUN_RECORD: record})
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        name = f"{self.sub}/part-{self.run}-{self.parts:05d}.parquet"
        self.out.commit_job()
        self.out.write_bytes(name, sink.getvalue().to_pybytes())
        self.parts += 1
        self.written += len(self.buffer)
        log.debug("wrote %s (%d rows)", name, len(self.buffer))
        self.buffer = []
        self.first_buffered = None


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
