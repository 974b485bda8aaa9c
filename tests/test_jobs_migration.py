"""Outputs of earlier versions. A job.json holding input_sha256 in its first form (every id
and text, not the Parquet footers): its job resumes when the input's texts still hash as that
form hashes them (and job.json then records the new hash); otherwise the refusal says the
input changed. Parts holding a column under its former name: read under the name now."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from knapspec_dist.errors import UserError
from knapspec_dist.jobs.output import ROWS, OutputDir, output_schema
from knapspec_dist.runtime.stages import FORMER_NAMES

import fakes as t


def old_digest(ids, docs) -> str:
    """input_sha256 in its first form: every id and text."""
    digest = hashlib.sha256()
    for row_id, text in zip(ids, docs):
        digest.update(repr(row_id).encode())
        digest.update(b"\0" if text is None else b"\1" + text.encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def as_old_version(out: Path, digest: str) -> str:
    """job.json rewritten as the earlier version would have written it; the new hash."""
    job = json.loads((out / "job.json").read_text())
    new = job["fingerprint"]["input_sha256"]
    job["fingerprint"]["input_sha256"] = digest
    (out / "job.json").write_text(json.dumps(job))
    return new


def test_an_output_of_the_earlier_version_resumes_and_is_migrated(tmp_path):
    ids, docs = list("abcde"), t.docs_of([3, 9, 5, 7, 4])[:4] + [None]
    t.write_input(tmp_path / "in.parquet", ids, docs)
    first, _ = t.run(t.job(tmp_path, stop_after=2, baseline_fraction=0))
    out = Path(first.output)
    new = as_old_version(out, old_digest(ids, docs))
    second, _ = t.run(t.job(tmp_path, baseline_fraction=0))
    assert second.skipped == 2 and second.summary["complete"]
    assert json.loads((out / "job.json").read_text())["fingerprint"]["input_sha256"] == new


def test_an_output_of_the_earlier_version_over_another_input_is_refused_saying_why(tmp_path):
    ids, docs = list("abc"), t.docs_of([3, 9, 5])
    t.write_input(tmp_path / "in.parquet", ids, docs)
    first, _ = t.run(t.job(tmp_path, stop_after=1, baseline_fraction=0))
    as_old_version(Path(first.output), old_digest(ids, [docs[0], docs[1], "edited"]))
    with pytest.raises(UserError, match="different input: the same path and row count, but "
                                        "its ids or texts changed"):
        t.run(t.job(tmp_path, baseline_fraction=0))


def with_former_names(out: Path) -> int:
    """Every part rewritten as an earlier version wrote it: ``rounds`` under its former name
    ``steps``; how many rows they hold."""
    rows = 0
    for part in sorted((out / "rows").glob("part-*.parquet")):
        table = pq.read_table(part)
        names = [FORMER_NAMES.get(n, n) for n in table.column_names]
        assert names != table.column_names
        pq.write_table(table.rename_columns(names), part)
        rows += len(table)
    return rows


def test_rows_of_an_earlier_version_read_their_renamed_columns(tmp_path):
    """A part holding ``steps`` (the former name of ``rounds``) is read with its values in
    ``rounds``, and the job resumes over it, skipping its rows."""
    ids, docs = list("abcd"), t.docs_of([3, 9, 5, 7])
    t.write_input(tmp_path / "in.parquet", ids, docs)
    first, _ = t.run(t.job(tmp_path, stop_after=2, baseline_fraction=0))
    out = Path(first.output)
    written = {r["id"]: r["rounds"] for r in t.read_rows(out)}
    assert with_former_names(out) == 2 and all(written.values())
    second, _ = t.run(t.job(tmp_path, baseline_fraction=0))
    assert second.skipped == 2 and second.summary["complete"]
    schema = output_schema("id", pa.string())
    rows = OutputDir(str(out)).read_rows(ROWS, schema).to_pylist()
    assert len(rows) == 4 and all(r["rounds"] for r in rows)
    assert {r["id"]: r["rounds"] for r in rows if r["id"] in written} == written
