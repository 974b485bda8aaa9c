"""What a job's files promise matches the run (fake engines, no Ray): no nan or inf in
job.json or summary.json, a summary that cannot be written keeps the rows and the job
resumable, ``job.guarantee`` and ``job.reproducible`` follow the sampling, and a resumed
job whose main pass had nothing left to do still describes it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from knapspec_dist.errors import UserError
from knapspec_dist.jobs import runner
from knapspec_dist.jobs.options import REJECTION_GUARANTEE
from knapspec_dist.jobs.summary import dumps
from knapspec_dist.runtime.messages import ReplicaInfo

from fakes import FakeEngines, docs_of, job, read_rows, run, write_input


def strict(path: Path) -> dict:
    """A JSON file read as strict JSON: a nan, inf or -inf in it fails."""
    def refuse(name):
        raise AssertionError(f"{path.name} holds {name}")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_summary_json_never_holds_a_non_finite_number():
    data = {"rate": math.nan, "rows": [1.0, math.inf, -math.inf], "kv": {"peak": math.nan},
            "ok": 0.5, "n": 3}
    assert json.loads(dumps(data)) == {"rate": None, "rows": [1.0, None, None],
                                       "kv": {"peak": None}, "ok": 0.5, "n": 3}


def test_a_summary_that_cannot_be_written_keeps_the_rows_and_the_job_resumes(tmp_path,
                                                                           monkeypatch):
    write_input(tmp_path / "in.parquet", ["a", "b", "c"], docs_of([3, 4, 5]))
    config = job(tmp_path, baseline_fraction=0)

    def fail(summary):
        raise ValueError("Out of range float values are not JSON compliant: nan")

    monkeypatch.setattr(runner, "dumps", fail)
    with pytest.raises(UserError, match=r"summary.json could not be written \(Out of range.*"
                                        r"the rows written are kept"):
        run(config)
    out = tmp_path / "out"
    assert sorted(r["id"] for r in read_rows(out)) == ["a", "b", "c"]
    assert not (out / "summary.json").exists() and not (out / ".lease.json").exists()
    strict(out / "job.json")
    monkeypatch.undo()
    again, engines = run(config)  # the same job: nothing to generate, the summary written
    assert engines.created == [] and again.summary["rows"]["ok"] == 3
    assert strict(out / "summary.json")["complete"] is True


@pytest.mark.parametrize("sampling,temperature,seed,guarantee,reproducible", [
    ("coupled", 0.0, None, "token-identical", True),
    ("rejection", 0.0, None, "token-identical", True),  # greedy: the same under both
    ("coupled", 0.8, 3, "token-identical", True),
    ("rejection", 0.8, 3, REJECTION_GUARANTEE, False),
    ("coupled", 0.8, None, "token-identical", False),  # no seed: each run its own draws
])
def test_the_summary_names_the_guarantee_and_whether_a_rerun_repeats_it(
        tmp_path, sampling, temperature, seed, guarantee, reproducible):
    write_input(tmp_path / "in.parquet", ["a", "b"], docs_of([3, 4]))
    result, _ = run(job(tmp_path, sampling=sampling, temperature=temperature, seed=seed,
                        baseline_fraction=0))
    s = strict(Path(result.summary_path))["job"]
    assert (s["guarantee"], s["reproducible"]) == (guarantee, reproducible)
    assert ("reproducible_note" in s) == (not reproducible)
    if sampling == "rejection" and not reproducible:
        assert "not reproducible run to run" in s["reproducible_note"]
        assert s["guarantee"] == "plain sampling's distribution, not its tokens " \
                                 "(--sampling rejection)"


PROFILE = {"key": "k", "path": "/p/k.json", "origin": "loaded"}


class Engines(FakeEngines):
    """Replicas that report their row cap and profile (ar: none); with ``stop_at``, the
    engine of that strategy cannot start: the run stops there, as a SIGTERM would stop it,
    before its summary."""

    def __init__(self, stop_at=None):
        super().__init__()
        self.stop_at = stop_at

    def __call__(self, config, strategy, replicas):
        if strategy.name == self.stop_at:
            raise KeyboardInterrupt
        return super().__call__(config, strategy, replicas)

    def replica_info(self, replica):
        return ReplicaInfo(replica, max_num_seqs=4,
                           profile=None if self.strategy == "ar" else PROFILE)


def test_a_resumed_job_with_no_main_pass_left_still_describes_it(tmp_path):
    """The first run wrote every row and the strategy's baseline pass, then stopped before
    ar's pass (no summary.json); the second runs only ar's pass, yet its summary gives the
    main pass's row cap and profile, from the records of the first run's parts."""
    write_input(tmp_path / "in.parquet", ["a", "b", "c", "d"], docs_of([3, 4, 5, 6]))
    config = job(tmp_path, baseline_fraction=0.5)
    with pytest.raises(KeyboardInterrupt):
        run(config, Engines(stop_at="ar"))
    assert not (tmp_path / "out" / "summary.json").exists()
    second, engines = run(config, Engines())
    assert [name for name, _ in engines.created] == ["ar"]  # the main pass had nothing left
    s = strict(Path(second.summary_path))
    assert s["throughput"]["max_num_seqs"] == s["run"]["max_num_seqs"] == 4
    assert s["run"]["profile"] == PROFILE
    third, engines = run(config, Engines())  # and again, with nothing at all to do
    assert engines.created == []
    assert third.summary["run"]["profile"] == PROFILE
    assert third.summary["throughput"]["max_num_seqs"] == 4
