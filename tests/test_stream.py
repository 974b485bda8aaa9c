"""The job's input streamed through Ray Data (runtime/stream.py), on a real local Ray.

* every row comes once, in tables of at most ``batch_rows`` rows;
* an early stop (``--stop-after``) leaves no thread of the iteration running: Ray Data's
  ``iter_batches`` left its consumer threads behind, and one that touches Ray after
  ``ray.shutdown`` ends the whole process with exit status 1 ("core worker has already been
  shutdown"), seen once in a scale run with every row written;
* a job of more rows than the driver tokenizes itself (``LOCAL_ROWS``: the Ray Data path),
  stopped after 5 rows and resumed, writes every row exactly once.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from knapspec_dist.jobs import JobConfig, run_job
from knapspec_dist.jobs.runner import LOCAL_ROWS
from knapspec_dist.runtime.stages import Stage
from knapspec_dist.runtime.stream import stream_batches

from stub_engine import StubBackend, StubEngines

pytestmark = pytest.mark.processes  # a local Ray and its actors

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stage class travels


class Same:
    """A stage that returns its batch (a little slowly: rows are still coming at a stop)."""

    def __call__(self, table: pa.Table) -> pa.Table:
        time.sleep(0.01)
        return table


@pytest.fixture(scope="module")
def cluster():
    os.environ["OMP_NUM_THREADS"] = "1"
    with pytest.MonkeyPatch.context() as env:
        # One actor reads the Parquet footers: Ray Data's default asks for 32, each a worker
        # process this 2-CPU Ray starts a few at a time, to read a few small files' footers.
        env.setenv("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", "1")
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()


def files(folder, n_files: int, rows: int) -> list[str]:
    folder.mkdir(exist_ok=True)
    out = []
    for f in range(n_files):
        path = str(folder / f"part-{f}.parquet")
        pq.write_table(pa.table({"id": [f"{f}-{i}" for i in range(rows)],
                                 "document": [f"row {i} of file {f}" for i in range(rows)]}),
                       path, row_group_size=20)
        out.append(path)
    return out


def stream(paths, batch_rows=16):
    return stream_batches(paths, pafs.LocalFileSystem(), ["id", "document"], Stage(Same, ()),
                          batch_rows=batch_rows, block_bytes=1 << 10)


@pytest.mark.e2e
def test_every_row_once_in_tables_of_at_most_batch_rows(cluster, tmp_path):
    paths = files(tmp_path / "in", 3, 150)
    tables = list(stream(paths))
    assert max(t.num_rows for t in tables) <= 16 and min(t.num_rows for t in tables) >= 1
    ids = [i for t in tables for i in t.column("id").to_pylist()]
    assert sorted(ids) == sorted(f"{f}-{i}" for f in range(3) for i in range(150))


@pytest.mark.e2e
def test_an_early_stop_leaves_no_thread_of_the_iteration_running(cluster, tmp_path):
    paths = files(tmp_path / "in", 3, 300)
    list(stream(paths[:1]))  # Ray Data's own lasting threads, if any, start here
    before = {t.ident for t in threading.enumerate()}
    batches = stream(paths)
    for _ in zip(range(3), batches):
        pass
    batches.close()
    deadline = time.monotonic() + 10  # the executor joins its thread within 2 s
    while True:
        left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == [], f"threads still running after the stream was closed: {left}"


def test_a_streamed_job_stopped_early_then_resumed_writes_every_row_once(cluster, tmp_path):
    n = LOCAL_ROWS + 200  # above it, Ray Data tokenizes (runtime/stream.py)
    folder = tmp_path / "in"
    files(folder, 2, n // 2)
    config = dict(input=str(folder), output=str(tmp_path / "out"), model="smollm2",
                  strategy="ar", max_new_tokens=2, baseline_fraction=0, progress_bar=False,
                  progress_seconds=1)
    stub = dict(engine_factory=StubEngines(0.01, 16), backend_factory=StubBackend)
    first = run_job(JobConfig(**config, stop_after=5), **stub)
    assert first.summary["complete"] is False
    rows = pq.read_table(tmp_path / "out" / "rows").column("id").to_pylist()
    assert len(rows) == 5
    second = run_job(JobConfig(**config), **stub)
    assert second.summary["complete"] is True
    rows = pq.read_table(tmp_path / "out" / "rows").column("id").to_pylist()
    assert sorted(rows) == sorted(f"{f}-{i}" for f in range(2) for i in range(n // 2))
