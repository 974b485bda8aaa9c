"""A bad run never locks its output: a job whose options failed every row is taken over by a
rerun with other options and ``--retry-failed``, and an output where a row succeeded stays
refused (fakes: no model, no Ray)."""

from __future__ import annotations

import json
import logging

import pyarrow.parquet as pq
import pytest

from knapspec_dist.errors import UserError

from fakes import FakeEngines, docs_of, job, read_rows, run, write_input


def write_books(folder) -> None:
    """Two documents past the fakes' 64-token window: a tree of two levels holds neither."""
    write_input(folder / "in.parquet", ["long", "longer"], docs_of([150, 400]))


def snapshot(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def fingerprint(out) -> dict:
    return json.loads((out / "job.json").read_text())["fingerprint"]


def test_a_rerun_with_retry_failed_takes_over_an_output_whose_rows_all_failed(tmp_path, caplog):
    write_books(tmp_path)
    out = tmp_path / "out"
    bad, _ = run(job(tmp_path, tree_depth=2, baseline_fraction=0.5))
    assert [r["error_kind"] for r in read_rows(bad.output)] == ["row", "row"]
    assert all("--tree-depth" in r["error"] for r in read_rows(bad.output))
    assert read_rows(bad.output, "nodes")  # chunk summaries of the failed trees
    before = snapshot(out)

    with pytest.raises(UserError, match=r"different job \(long_documents: .*every row it holds "
                                        "failed: --retry-failed takes it over"):
        run(job(tmp_path, baseline_fraction=0.5))  # corrected, without --retry-failed
    assert snapshot(out) == before

    caplog.set_level(logging.WARNING, logger="knapspec_dist.jobs")
    good, engines = run(job(tmp_path, baseline_fraction=0.5, retry_failed=True))
    taken = [r.getMessage() for r in caplog.records if "takes it over" in r.getMessage()]
    assert len(taken) == 1 and "held only failed rows of another job" in taken[0]
    assert fingerprint(out)["long_documents"]["max_depth"] == 8

    (tmp_path / "fresh").mkdir()  # the same corrected job in a new output
    write_books(tmp_path / "fresh")
    fresh, fresh_engines = run(job(tmp_path / "fresh", baseline_fraction=0.5))
    table = pq.read_table(out / "rows")  # as any reader reads the folder
    assert sorted(table.column("id").to_pylist()) == ["long", "longer"]  # each row once
    rows = {r["id"]: r for r in table.to_pylist()}
    want = {r["id"]: r for r in read_rows(fresh.output)}
    assert all(r["error"] is None and r["document_path"] == "tree" for r in rows.values())
    assert {k: r["generated_text"] for k, r in rows.items()} == {
        k: r["generated_text"] for k, r in want.items()}
    assert len(engines.submits) == len(fresh_engines.submits)  # no old node reused
    nodes = pq.read_table(out / "nodes").to_pylist()
    places = [(n["pass"], n["id"], n["level"], n["index"]) for n in nodes]
    assert len(places) == len(set(places)) == len(read_rows(fresh.output, "nodes"))
    assert len({n["config"] for n in nodes}) == 1
    assert list((out / "rows").glob(".superseded-part-*.parquet"))  # kept, never read
    assert list((out / "nodes").glob(".superseded-part-*.parquet"))
    assert good.summary["rows"]["ok"] == 2 and good.summary["rows"]["failed"] == 0
    assert good.summary["run"]["resumed"] is False
    assert good.summary["baseline"]["rows"] == fresh.summary["baseline"]["rows"] >= 1

    again, engines = run(job(tmp_path, baseline_fraction=0.5))  # its own output now
    assert engines.created == [] and again.summary["run"]["resumed"] is True


def test_an_output_where_a_row_succeeded_stays_refused(tmp_path):
    write_input(tmp_path / "in.parquet", ["short", "long"], docs_of([10, 400]))
    out = tmp_path / "out"
    run(job(tmp_path, tree_depth=2, baseline_fraction=0))
    assert [r["error"] is None for r in read_rows(str(out))] == [True, False]
    before = snapshot(out)
    for retry_failed in (False, True):
        with pytest.raises(UserError) as e:
            run(job(tmp_path, baseline_fraction=0, retry_failed=retry_failed))
        assert "holds rows of a different job (long_documents: " in str(e.value)
        assert ("--retry-failed takes over an output only when every row it holds failed, "
                "and rows of this one succeeded") in str(e.value)
    assert snapshot(out) == before
    kept, _ = run(job(tmp_path, tree_depth=2, baseline_fraction=0, retry_failed=True))
    assert kept.summary["run"]["resumed"] is True  # its own job still resumes into it
    assert (kept.summary["rows"]["ok"], kept.summary["rows"]["failed"]) == (1, 1)


def test_tree_nodes_alone_do_not_lock_an_output(tmp_path):
    """A run killed inside its first tree leaves nodes and no row: other options with
    --retry-failed take the output over; the nodes' configuration is not theirs."""

    class Crash(BaseException):  # like SIGKILL: not a row's error
        pass

    def crash(answered, backend):
        if answered == 5:
            raise Crash()

    write_input(tmp_path / "in.parquet", ["longer"], docs_of([400]))
    with pytest.raises(Crash):
        run(job(tmp_path, baseline_fraction=0), FakeEngines(after_answers=crash))
    out = tmp_path / "out"
    assert not list((out / "rows").glob("part-*")) and list((out / "nodes").glob("part-*"))
    with pytest.raises(UserError, match="every row it holds failed"):
        run(job(tmp_path, baseline_fraction=0, max_new_tokens=5))
    result, _ = run(job(tmp_path, baseline_fraction=0, max_new_tokens=5, retry_failed=True))
    assert [r["error"] for r in read_rows(result.output)] == [None]
    assert fingerprint(out)["max_new_tokens"] == 5


def test_a_takeover_stopped_before_its_first_part_leaves_an_output_with_no_rows(tmp_path):
    """The other job's parts are set aside before job.json changes: a takeover that fails to
    start leaves the old job.json over no visible part, which any options start over."""
    write_books(tmp_path)
    out = tmp_path / "out"
    run(job(tmp_path, tree_depth=2, baseline_fraction=0))
    old = (out / "job.json").read_bytes()

    def no_engine(config, strategy, replicas):
        raise UserError("the cluster has 0 GPU(s)")

    with pytest.raises(UserError, match="0 GPU"):
        run(job(tmp_path, baseline_fraction=0, retry_failed=True), no_engine)
    assert (out / "job.json").read_bytes() == old
    assert not list(out.rglob("part-*.parquet"))  # only the hidden .superseded- names
    result, _ = run(job(tmp_path, max_new_tokens=5, baseline_fraction=0))
    assert [r["error"] for r in read_rows(result.output)] == [None, None]
