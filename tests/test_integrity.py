"""Output integrity: one writer per output (the lease), exactly once on read, out
of memory retried instead of written as a final error, and the cosmetic defects.

The unit tests use test_jobs.py's fakes (no Ray). The real ones run the user's command,
``python -m knapspec_dist.cli.main job ...``, on SmolLM2 with ``--strategy ar``, 4 new
tokens and 12 short rows: two jobs into one output at once (one module-scoped run whose
output the duplicate and stale-lease tests copy; their reruns have nothing to generate and
start no Ray; one rerun for both), and a ``--max-num-seqs`` that cannot fit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.exceptions as rx
import torch
from ray.exceptions import RayTaskError

from knapspec_dist.cli.job import add_job_args, config_from_args
from knapspec_dist.errors import UserError
from knapspec_dist.jobs import JobConfig, report, run_job
from knapspec_dist.jobs.lease import LEASE_FILE, Lease, LeaseHeld
from knapspec_dist.jobs.output import OutputDir, output_schema, result_row
from knapspec_dist.runtime import backend as rb
from knapspec_dist.runtime.dispatch import Dispatcher, Task

import fakes as t
from conftest import subprocess_env

pytestmark = pytest.mark.processes  # jobs on a Ray of their own

REPO = Path(__file__).resolve().parent.parent
J = ["--model", "smollm2", "--max-new-tokens", "4", "--baseline-fraction", "0", "--strategy",
     "ar", "--no-progress-bar"]


def knapspec_job(*args: str):
    return [sys.executable, "-m", "knapspec_dist.cli.main", "job", *args]


def job_run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(knapspec_job(*args), cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


def errors_of(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_lease(folder: Path, **fields) -> None:
    now = time.time()
    data = {"run": "old-run", "host": socket.gethostname(), "pid": os.getpid(),
            "pid_started": None, "started_at": "", "heartbeat": now, **fields}
    (folder / LEASE_FILE).write_text(json.dumps(data))


# ----------------------------------------------------------------------------- lease (unit)


def test_a_live_lease_refuses_a_second_job_and_writes_nothing(tmp_path):
    t.write_input(tmp_path / "in.parquet", ["a", "b"], t.docs_of([3, 4]))
    (tmp_path / "out").mkdir()
    write_lease(tmp_path / "out", run="first-run")  # this very process: alive
    engines = t.FakeEngines()
    with pytest.raises(UserError, match=r"--output '.*out' is in use by another job \(run "
                                        r"first-run, host .*, pid \d+, heartbeat 0 s ago\)"):
        t.run(t.job(tmp_path), engines)
    assert engines.created == []
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [LEASE_FILE]


def test_a_stale_lease_is_taken_over_with_a_warning(tmp_path, caplog):
    out = OutputDir(str(tmp_path / "o"))
    (tmp_path / "o").mkdir()
    write_lease(tmp_path / "o", host="elsewhere", pid=1, heartbeat=time.time() - 3600)
    lease = Lease(out)
    with caplog.at_level(logging.WARNING):
        lease.acquire()
    try:
        assert "no heartbeat for" in caplog.text and "taking over" in caplog.text
        held = json.loads((tmp_path / "o" / LEASE_FILE).read_text())
        assert held["run"] == lease.run_id and held["pid"] == os.getpid()
        with pytest.raises(LeaseHeld, match="is in use by another job"):
            Lease(OutputDir(str(tmp_path / "o"))).acquire()  # ours is live now
        lease.refresh()
        assert json.loads((tmp_path / "o" / LEASE_FILE).read_text())["heartbeat"] >= \
            held["heartbeat"]
    finally:
        lease.release()
    assert not (tmp_path / "o" / LEASE_FILE).exists()


def test_the_lease_is_released_when_the_job_fails(tmp_path):
    t.write_input(tmp_path / "in.parquet", ["a"], t.docs_of([3]))
    (tmp_path / "out").mkdir()

    class Crash(BaseException):
        pass

    def crash(answered, backend):
        raise Crash()

    with pytest.raises(Crash):
        t.run(t.job(tmp_path, baseline_fraction=0), t.FakeEngines(after_answers=crash))
    assert not (tmp_path / "out" / LEASE_FILE).exists()


# ----------------------------------------------------------------------------- exactly once on read


def test_a_copied_part_file_is_read_once_with_a_warning(tmp_path, caplog):
    t.write_input(tmp_path / "in.parquet", list("abc"), t.docs_of([3, 4, 5]))
    first, _ = t.run(t.job(tmp_path, baseline_fraction=0))
    parts = sorted((tmp_path / "out" / "rows").glob("part-*.parquet"))
    shutil.copy(parts[0], parts[0].with_name("part-zcopy.parquet"))
    with caplog.at_level(logging.WARNING):
        again, engines = t.run(t.job(tmp_path, baseline_fraction=0))
    rows = again.summary["rows"]
    assert (rows["ok"], rows["written"], rows["input"]) == (3, 3, 3), rows
    assert "1 duplicate row(s) dropped" in caplog.text
    assert engines.created == []


def test_a_success_wins_over_an_error_and_the_earliest_success_is_kept(tmp_path):
    out = OutputDir(str(tmp_path / "o"))
    out.prepare({"x": 1})
    schema = output_schema("id", pa.string())

    def part(name, rows):
        table = pa.Table.from_pylist(rows, schema=schema)
        os.makedirs(tmp_path / "o" / "rows", exist_ok=True)
        pq.write_table(table, tmp_path / "o" / "rows" / name)

    ok_early = result_row("id", "a", "ar")
    ok_early["generated_text"] = "early"
    time.sleep(0.01)
    ok_late = result_row("id", "a", "ar")
    ok_late["generated_text"] = "late"
    part("part-1.parquet", [result_row("id", "a", "ar", error="boom")])
    part("part-2.parquet", [ok_late])
    part("part-3.parquet", [ok_early, result_row("id", "b", "ar", error="x")])
    rows = out.read_rows("rows", schema).to_pylist()
    assert [(r["id"], r["generated_text"], r["error"]) for r in rows] == [
        ("a", "early", None), ("b", None, "x")]


# ----------------------------------------------------------------------------- out of memory


class OomBackend(t.FakeBackend):
    """Row (7,) runs out of memory on its first try; the failure is classified by the real
    runtime/backend.py (a RayTaskError wraps the shard's torch.OutOfMemoryError)."""

    def __init__(self, engine):
        super().__init__(engine)
        self.smaller = []
        self.ooms = 0

    def result(self, h):
        ids = tuple(self.handles[h]["ids"])
        if ids == (7,) and not self.ooms:
            self.handles.pop(h)
            self.ooms += 1
            raise _ray_task_error(torch.OutOfMemoryError("CUDA out of memory"))
        return super().result(h)

    def restart(self, replica, smaller=False):
        self.smaller.append(smaller)
        super().restart(replica)

    def is_replica_failure(self, exc):  # the rows the restart took down: ReplicaDied
        return isinstance(exc, t.ReplicaDied) or rb.is_replica_failure(exc)

    def is_out_of_memory(self, exc):
        return rb.is_out_of_memory(exc)


def _ray_task_error(cause: BaseException) -> BaseException:
    return RayTaskError("generate", "traceback", cause).as_instanceof_cause()


def test_out_of_memory_restarts_the_replica_smaller_and_retries_the_row():
    engines = t.FakeEngines()
    engines.strategy, engines.num_replicas = "ar", 1
    backend = OomBackend(engines)
    sched = Dispatcher(backend, JobConfig(input="x", output="y").generation_config(),
                       max_inflight=2, restart_backoff=0)
    got = []
    sched.run([Task("a", [7]), Task("b", [8])], got.append)
    assert sorted(o.task.key for o in got) == ["a", "b"]
    assert all(o.error is None for o in got), [o.error for o in got]
    assert engines.restarts == [0] and backend.smaller == [True]
    assert {o.task.key: o.task.attempts for o in got}["a"] == 2


def test_oom_and_ray_oom_killer_are_replica_failures():
    for exc in (rx.OutOfMemoryError("the OOM killer stopped the worker"),
                _ray_task_error(torch.OutOfMemoryError("out of memory")),
                _ray_task_error(MemoryError())):
        assert rb.is_replica_failure(exc) and rb.is_out_of_memory(exc), exc
    assert not rb.is_replica_failure(_ray_task_error(ValueError("a row's own error")))


def test_rows_failed_for_a_retryable_reason_are_retried_by_a_rerun(tmp_path):
    t.write_input(tmp_path / "in.parquet", ["a", "b", "c"], t.docs_of([4, 6, 8]))
    engines = t.FakeEngines(poison=lambda key: len(key) == 11)  # b kills its replica
    first, _ = t.run(t.job(tmp_path, max_attempts=2, baseline_fraction=0), engines)
    rows = {r["id"]: r for r in t.read_rows(first.output)}
    assert rows["b"]["error"].startswith("replica failed 2 time(s)")
    assert rows["b"]["error_kind"] == "replica"
    again, e2 = t.run(t.job(tmp_path, baseline_fraction=0))  # the replica is healthy now
    assert [len(s[1]) for s in e2.submits] == [11]  # only b
    assert again.summary["rows"]["ok"] == 3 and again.summary["rows"]["failed"] == 0


def test_retry_failed_retries_every_failed_row_and_a_plain_rerun_does_not(tmp_path):
    t.write_input(tmp_path / "in.parquet", ["a", "b", "c"], t.docs_of([4, 6, 8]))
    t.run(t.job(tmp_path, baseline_fraction=0), t.FakeEngines(row_error=lambda k: len(k) == 11))
    plain, e2 = t.run(t.job(tmp_path, baseline_fraction=0))
    assert e2.created == [] and plain.summary["rows"]["failed"] == 1  # a row's own error
    retried, e3 = t.run(t.job(tmp_path, baseline_fraction=0, retry_failed=True))
    assert [len(s[1]) for s in e3.submits] == [11]
    assert retried.summary["rows"]["ok"] == 3 and retried.summary["rows"]["failed"] == 0

    p = argparse.ArgumentParser()
    add_job_args(p)
    args = p.parse_args(["--input", "i", "--output", "o", "--retry-failed"])
    assert config_from_args(args).retry_failed is True


# ----------------------------------------------------------------------------- cosmetic


def test_a_rerun_with_nothing_to_do_keeps_numbers_numbers(tmp_path):
    t.write_input(tmp_path / "in.parquet", ["a", "b"], t.docs_of([3, 4]))
    first, _ = t.run(t.job(tmp_path, baseline_fraction=0.5))
    again, engines = t.run(t.job(tmp_path, baseline_fraction=0.5))
    assert engines.created == []
    assert again.summary["throughput"]["max_num_seqs"] == first.summary["throughput"][
        "max_num_seqs"] == 1
    assert again.summary["run"]["max_num_seqs"] == 1
    assert "None" not in report(again)


def test_a_failed_start_leaves_no_folders(tmp_path):
    t.write_input(tmp_path / "in.parquet", ["a"], t.docs_of([3]))

    def no_engine(config, strategy, replicas):
        raise UserError("the cluster has 0 GPU(s)")

    with pytest.raises(UserError, match="0 GPU"):
        run_job(t.job(tmp_path), engine_factory=no_engine, backend_factory=t.FakeBackend,
                  text_tools=t.fake_tools())
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()  # an existing empty folder stays, empty
    with pytest.raises(UserError, match="0 GPU"):
        run_job(t.job(tmp_path), engine_factory=no_engine, backend_factory=t.FakeBackend,
                  text_tools=t.fake_tools())
    assert list((tmp_path / "out").iterdir()) == []


def test_a_folder_of_other_files_is_named_for_what_it_is(tmp_path):
    t.write_input(tmp_path / "in.parquet", ["a"], t.docs_of([3]))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(UserError) as e:
        t.run(t.job(tmp_path))
    assert str(e.value).endswith("holds files but no job.json: not a knapspec job's output; "
                                 "choose an empty or new folder")


# ----------------------------------------------------------------------------- real jobs


@pytest.fixture(scope="module")
def twelve_rows(tmp_path_factory) -> Path:
    """The bundled sample's 12 ids with short documents (the first sentences)."""
    table = pq.read_table(REPO / "knapspec_dist" / "data" / "sample_chapters.parquet")
    docs = [" ".join(d.split()[:30]) for d in table.column("document").to_pylist()]
    path = tmp_path_factory.mktemp("in") / "docs12.parquet"
    pq.write_table(pa.table({"id": table.column("id"), "document": docs}), path)
    return path


@pytest.fixture(scope="module")
def two_jobs(twelve_rows, tmp_path_factory):
    """Two jobs into one output, the second started while the first runs."""
    out = tmp_path_factory.mktemp("two") / "O"
    args = ["--input", str(twelve_rows), "--output", str(out), *J, "--checkpoint-rows", "1",
            "--address", "local"]
    first = subprocess.Popen(knapspec_job(*args), cwd=REPO, env=subprocess_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / LEASE_FILE).exists() and first.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    second = job_run(*args)
    stdout, stderr = first.communicate(timeout=900)
    return out, first, (stdout, stderr), second


@pytest.mark.e2e
def test_two_jobs_into_one_output_write_every_row_once(two_jobs):
    out, first, (stdout, stderr), second = two_jobs
    assert first.returncode == 0, stderr[-3000:]
    assert second.returncode == 2, second.stderr[-3000:]
    errors = errors_of(second)
    assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert f"--output '{out}' is in use by another job (run " in errors[0]
    assert f"pid {first.pid}," in errors[0] and "heartbeat" in errors[0]
    rows = pq.read_table(out / "rows").to_pylist()
    assert len(rows) == 12 and len({r["id"] for r in rows}) == 12
    assert "12 ok, 0 failed, 0 pending (of 12" in stdout
    assert not (out / LEASE_FILE).exists()  # released at the end


@pytest.mark.e2e
def test_a_rerun_counts_a_copied_part_once_and_takes_over_a_dead_processs_lease(
        two_jobs, twelve_rows, tmp_path):
    """The finished output with a copy of one part file and the lease of a process that is
    gone (a fresh heartbeat): one rerun warns of both, takes the lease over and counts every
    row once."""
    out = tmp_path / "O"
    shutil.copytree(two_jobs[0], out)
    part = sorted((out / "rows").glob("part-*.parquet"))[0]
    shutil.copy(part, part.with_name("part-copy.parquet"))
    write_lease(out, run="killed-run", pid=dead_pid())  # fresh heartbeat, but no process
    proc = job_run("--input", str(twelve_rows), "--output", str(out), *J)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rows: 12 ok, 0 failed, 0 pending (of 12;" in proc.stdout, proc.stdout
    assert "WARNING" in proc.stderr and "1 duplicate row(s) dropped" in proc.stderr
    assert "of None" not in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"]["ok"] == 12 and summary["rows"]["written"] == 12
    assert summary["throughput"]["max_num_seqs"] is not None
    assert "taking over the lease of run killed-run" in proc.stderr
    assert "is not running on this host" in proc.stderr
    assert not (out / LEASE_FILE).exists()


@pytest.mark.e2e
def test_a_kv_cache_too_small_for_one_row_is_refused_before_any_replica_starts(twelve_rows,
                                                                              tmp_path):
    """``--max-num-seqs`` is only a cap; what must fit is one row of ``--max-model-len`` in
    the KV cache, checked from the model config before Ray starts."""
    small = tmp_path / "two.parquet"
    pq.write_table(pq.read_table(twelve_rows).slice(0, 2), small)
    out = tmp_path / "O"
    start = time.monotonic()
    proc = job_run("--input", str(small), "--output", str(out), *J, "--max-num-seqs", "100000",
                   "--kv-cache-memory", "10MB", "--address", "local", timeout=300)
    errors = errors_of(proc)
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    # 10 MB / 46,080 B a position: 13 pages of 16, one of them the scratch page
    assert "the KV cache holds 192 tokens per rank" in errors[0]
    assert "needs" in errors[0] and "--max-model-len" in errors[0]
    assert "weights in" not in proc.stderr  # no shard loaded its weights
    assert time.monotonic() - start < 240
    assert not out.exists()


def test_a_dispatcher_keeps_no_callback_or_input_past_its_run():
    """The processor's stage holds its dispatcher: a callback kept past the run would close a
    reference cycle, and the stage (with its replica's placement group) would only be freed
    by the garbage collector, after Ray disconnected."""
    engines = t.FakeEngines()
    engines.strategy, engines.num_replicas = "ar", 1
    sched = Dispatcher(t.FakeBackend(engines), JobConfig(input="x", output="y")
                       .generation_config(), max_inflight=2)

    class Sink(list):
        pass

    sink = Sink()
    alive = weakref.ref(sink)
    sched.run(iter([Task("a", [7]), Task("b", [8])]), sink.append)
    assert sorted(o.task.key for o in sink) == ["a", "b"]
    del sink
    assert alive() is None
