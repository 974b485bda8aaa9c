"""User-facing behaviours, run as the user runs them (``knapspec job`` / ``knapspec
generate`` in a fresh process, as tests/test_bad_setups.py does): SIGTERM and SIGINT to a
running job, a non-UTF-8 prompt file.  Invalid UTF-8 in an input row is checked by
tests/test_bad_setups.py's job (one job for both); the unit tests of profile validation are
in tests/test_profile_checks.py, those of a job's report in tests/test_job_report.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import subprocess_env

REPO = Path(__file__).resolve().parent.parent
AR = ["--model", "smollm2", "--strategy", "ar", "--baseline-fraction", "0", "--no-progress-bar"]
SHORT = ["The cat sat on the mat. It was a sunny day.", "Rain fell all night on the town.",
         "A dog ran after a red ball in the park.", "The river was cold and quick.",
         "Bread was baked at dawn in the old oven.", "Snow covered every roof by noon."]


def knapspec_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "knapspec_dist.cli.main", *args]


def knapspec(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(knapspec_cmd(*args), cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


def rows_of(out: Path) -> dict:
    return {r["id"]: r for r in pq.read_table(out / "rows").to_pylist()}


def _start_and_stop(inp: Path, out: Path, sig: int) -> subprocess.CompletedProcess:
    """``knapspec job`` in its own session (like a terminal's foreground job); once its first
    row is on disk, ``sig`` goes to it (SIGTERM: as ``ray job stop`` / ``kill``) or to its
    whole process group (SIGINT: as Ctrl-C in a terminal).  "First row": a part file this
    run wrote (the rows a resumed run finds are older)."""
    cmd = knapspec_cmd("job", "--input", str(inp), "--output", str(out), *AR,
                       "--max-new-tokens", "32", "--max-num-seqs", "1", "--max-inflight", "1",
                       "--checkpoint-rows", "1")
    before = set((out / "rows").glob("part-*.parquet"))
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not set((out / "rows").glob("part-*.parquet")) - before:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job wrote no row in time"
        time.sleep(0.1)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _stopped_cleanly(proc: subprocess.CompletedProcess, code: int, word: str) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines()
                if "WARNING knapspec_dist" in line and word in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "run the same job again to continue" in warnings[0]


def test_sigint_and_sigterm_stop_a_job_with_its_rows_kept(tmp_path):
    """Ctrl-C (SIGINT to the process group): exit 130; SIGTERM: exit 143; each time one
    warning line, no traceback, the finished rows kept; the third run finishes the job with
    every row once."""
    inp = tmp_path / "in.parquet"
    ids = [f"r{i}" for i in range(len(SHORT))]
    pq.write_table(pa.table({"id": ids, "document": SHORT}), inp)
    out = tmp_path / "out"
    first = _start_and_stop(inp, out, signal.SIGINT)
    _stopped_cleanly(first, 130, "interrupted (SIGINT)")
    kept = rows_of(out)
    assert 1 <= len(kept) < len(ids)
    second = _start_and_stop(inp, out, signal.SIGTERM)
    _stopped_cleanly(second, 143, "terminated (SIGTERM)")
    assert set(kept) < set(rows_of(out))  # it went on from the first run's rows
    third = knapspec("job", "--input", str(inp), "--output", str(out), *AR,
                     "--max-new-tokens", "32", "--max-num-seqs", "1", "--max-inflight", "1",
                     "--checkpoint-rows", "1")
    assert third.returncode == 0, third.stderr[-3000:]
    table = pq.read_table(out / "rows")
    assert sorted(table.column("id").to_pylist()) == sorted(ids)  # every row exactly once
    assert all(e is None for e in table.column("error").to_pylist())


@pytest.mark.e2e
def test_a_non_utf8_prompt_file_is_one_error_line(tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"\xff\xfe bad")
    proc = knapspec("generate", "--prompt-file", str(bad), "--max-new-tokens", "2")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and str(bad) in errors[0] and "not valid UTF-8" in errors[0], errors
