"""The summary, the baseline choice and resume's done ids computed by streaming over the
output's parts (jobs/summary.py, jobs/baseline.py, jobs/resume.py): the same figures as from
the whole output at once, one row per id across parts, and no Python object per row."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from knapspec_dist.jobs.baseline import baseline_ids, choose_baseline
from knapspec_dist.jobs.output import (
    BASELINE,
    BASELINE_STRATEGY,
    ROWS,
    OutputDir,
    output_schema,
    result_row,
)
from knapspec_dist.jobs.resume import read_done
from knapspec_dist.jobs.summary import COLUMNS, summarize

import fakes as t


def _close(a, b, path="summary"):
    """Equal, floats to 1e-9 relative (sums in another order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert set(a) == set(b), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9), path
    else:
        assert a == b, path


def test_the_streamed_summary_equals_the_whole_outputs_on_a_worked_job(tmp_path):
    """A job of 12 rows (one null text), one part per row, with baseline passes; then a part
    copied by hand (its row must count once): the summary the job wrote, the one streamed
    over the parts and the one of the whole table at once agree."""
    docs = t.docs_of([5, 30, 9, 3, 17, 22, 11, 4, 28, 6, 13])
    t.write_input(tmp_path / "in.parquet", [f"r{i}" for i in range(12)], docs + [None])
    result, _ = t.run(t.job(tmp_path, baseline_fraction=0.3))
    out_dir = Path(result.output)
    parts = sorted((out_dir / ROWS).glob("part-*.parquet"))
    assert len(parts) == 12
    shutil.copy(parts[3], out_dir / ROWS / "part-zz-copy.parquet")
    out = OutputDir(result.output)
    schema = output_schema("id", pa.string())
    ids = pa.chunked_array([pa.array([f"r{i}" for i in range(12)] + ["gone"])])
    base, again = (out.read_rows(sub, schema) for sub in (BASELINE, BASELINE_STRATEGY))
    streamed = summarize(out.iter_rows(ROWS, schema, ["id", *COLUMNS]), base, "id", ids,
                         {"strategy": "knapspec"}, {}, again=again)
    whole = out.read_rows(ROWS, schema)
    assert len(whole) == 12  # the copied part's row once
    _close(streamed, summarize(whole, base, "id", ids.to_pylist(), {"strategy": "knapspec"},
                               {}, again=again))
    assert streamed["rows"] == {"input": 13, "written": 12, "ok": 11, "failed": 1,
                                "pending": 1, "not_in_input": 0, "generations": 11,
                                "document_paths": {"whole": 11}}
    assert not streamed["complete"] and streamed["baseline"]["rows"] == 4
    written = json.loads(Path(result.summary_path).read_text())  # before the copy
    again_streamed = summarize(out.iter_rows(ROWS, schema, ["id", *COLUMNS]), base, "id",
                               ids.filter(pa.array([i < 12 for i in range(13)])),
                               {"strategy": "knapspec"}, {}, again=again)
    for key in ("complete", "rows", "errors", "tokens", "acceptance", "buckets", "baseline"):
        _close(json.loads(json.dumps(again_streamed[key], default=str)), written[key], key)
    # the baseline choice over Arrow columns is choose_baseline's
    rows = [(r["id"], r["num_input_tokens"]) for r in whole.to_pylist() if r["error"] is None]
    assert set(baseline_ids(out, schema, 0.3).to_pylist()) == choose_baseline(rows, 0.3)
    done = read_done(out, schema, ids, retry_failed=True)
    assert (done.in_input, done.pending, done.retry, len(done.rows)) == (11, 2, 1, 11)


def test_summarizing_streamed_parts_holds_no_python_object_per_row(tmp_path):
    """20,000 rows in 40 parts: the Python heap the streamed summary allocates at its peak
    stays far below what the rows as dicts take (about 2 KB each)."""
    out = OutputDir(str(tmp_path / "o"))
    out.prepare({"x": 1})
    schema = output_schema("id", pa.int64())
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    per_part = 500
    (Path(out.path) / ROWS).mkdir()
    for p in range(40):
        n = pa.array(range(p * per_part, (p + 1) * per_part), pa.int64())
        start = pa.array([t0 + dt.timedelta(seconds=i * 0.01) for i in n.to_pylist()],
                         pa.timestamp("us", tz="UTC"))
        row = result_row("id", 0, "knapspec")
        columns = {name: pa.nulls(per_part, schema.field(name).type) for name in schema.names}
        columns.update(id=n, num_input_tokens=pa.array([100 + i % 5000 for i in range(per_part)],
                                                       pa.int64()),
                       num_generated_tokens=pa.array([8] * per_part, pa.int64()),
                       generated_tokens=pa.array([[1] * 8] * per_part, pa.list_(pa.int32())),
                       time_taken_llm=pa.array([0.5] * per_part), replica=pa.array(
                           [p % 3] * per_part, pa.int32()), drafted=pa.array([4] * per_part),
                       accepted=pa.array([2] * per_part), generation_start=start,
                       generation_end=start, finished_at=pa.array(
                           [row["finished_at"]] * per_part, pa.timestamp("us", tz="UTC")))
        table = pa.table({k: columns[k].cast(schema.field(k).type) for k in schema.names})
        pq.write_table(table, out.join(ROWS, f"part-{p:05d}.parquet"))
    ids = pa.chunked_array([pa.array(range(40 * per_part), pa.int64())])
    empty = schema.empty_table()
    tracemalloc.start()
    s = summarize(out.iter_rows(ROWS, schema, ["id", *COLUMNS]), empty, "id", ids,
                  {"strategy": "knapspec"}, {})
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert s["rows"]["written"] == 20_000 and s["complete"]
    assert s["tokens"]["generated"] == 160_000 and s["acceptance"]["acceptance_rate"] == 0.5
    assert peak < 4_000_000, f"{peak} bytes at the peak"
