"""User-facing behaviours, run as the user runs them (``knapspec job`` / ``knapspec
generate`` in a fresh process, as tests/test_bad_setups.py does): SIGTERM and SIGINT to a
running job's process group, SIGKILL of a job that started its own Ray, a non-UTF-8
prompt file.  Invalid UTF-8 in an input row is checked by
tests/test_bad_setups.py's job (one job for both); the unit tests of profile validation are
in tests/test_profile_checks.py, those of a job's report in tests/test_job_report.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from knapspec_dist.runtime.local_ray import session_members

from conftest import subprocess_env

pytestmark = pytest.mark.processes  # CLI jobs, each with a Ray of its own

REPO = Path(__file__).resolve().parent.parent
AR = ["--model", "smollm2", "--strategy", "ar", "--baseline-fraction", "0", "--no-progress-bar"]
SHORT = ["The cat sat on the mat. It was a sunny day.", "Rain fell all night on the town.",
         "A dog ran after a red ball in the park.", "The river was cold and quick.",
         "Bread was baked at dawn in the old oven.", "Snow covered every roof by noon.",
         "The train left the station at six.", "Birds sang in the tall oak tree."]


def knapspec_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "knapspec_dist.cli.main", *args]


def knapspec(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(knapspec_cmd(*args), cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


def rows_of(out: Path) -> dict:
    return {r["id"]: r for r in pq.read_table(out / "rows").to_pylist()}


#: A job on a Ray of its own (not one another test left to be found on the machine) that
#: writes each row as it finishes, one row at a time: a signal after its first row finds
#: the others unfinished.
ONE_BY_ONE = [*AR, "--address", "local", "--max-new-tokens", "16", "--max-num-seqs", "1",
              "--max-inflight", "1", "--checkpoint-rows", "1"]
#: An ERROR line of this process or of an actor (Python logging), or of Ray's C++ core
#: (``[2026-01-01 12:00:00,000 E 123 456] rpc_client.h:204: ...``).
ERROR_LINE = re.compile(r" ERROR |\[[^\]]* E \d+ \d+\]")


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
            found.append(int(entry))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def _ray_session_of(pid: int) -> int:
    """The session of the local Ray the job ``pid`` started: its keeper's pid (the keeper,
    runtime/local_ray.py, starts a session of its own)."""
    for child in _children(pid):
        if "local_ray.py" in _cmdline(child):
            return child
    raise AssertionError(f"job {pid} has no local Ray keeper")


def _gone(session: int, within_s: float) -> list[int]:
    """The live processes of ``session`` once it is empty or ``within_s`` passed; what is
    left then (provably that Ray's) is killed, so a failure leaves no cluster behind."""
    deadline = time.monotonic() + within_s
    while (left := session_members(session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _start(inp: Path, out: Path) -> tuple[subprocess.Popen, int]:
    """``knapspec job`` in its own session (like a terminal's foreground job), until its
    first row is on disk ("first row": a part file this run wrote; the rows a resumed run
    finds are older); the process and the session of the local Ray it started, which is
    not the job's."""
    cmd = knapspec_cmd("job", "--input", str(inp), "--output", str(out), *ONE_BY_ONE)
    before = set((out / "rows").glob("part-*.parquet"))
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while not set((out / "rows").glob("part-*.parquet")) - before:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job wrote no row in time"
            time.sleep(0.1)
        session = _ray_session_of(proc.pid)
        assert session != os.getsid(proc.pid) and len(session_members(session)) > 2
    except BaseException:
        proc.kill()  # its keeper then ends its Ray
        proc.communicate(timeout=120)
        raise
    return proc, session


def _start_and_stop(inp: Path, out: Path, sig: int) -> subprocess.CompletedProcess:
    """Once the job's first row is on disk, ``sig`` goes to its whole process group, as
    Ctrl-C in a terminal, ``timeout``, a scheduler's cancel or a container stop send it.
    No process of the job's Ray is left once the job exited."""
    proc, session = _start(inp, out)
    os.killpg(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert _gone(session, 10) == [], stderr[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _stopped_cleanly(proc: subprocess.CompletedProcess, code: int, word: str) -> None:
    """Exit ``code`` and one warning line; no traceback, no ERROR of the actors the job
    stopped itself, no wait on a GCS the signal ended."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Failed to connect to GCS" not in proc.stderr, proc.stderr[-3000:]
    assert not [line for line in proc.stderr.splitlines() if ERROR_LINE.search(line)], \
        proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines()
                if "WARNING knapspec_dist" in line and word in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "run the same job again to continue" in warnings[0]


def _input(tmp_path: Path) -> tuple[Path, list[str]]:
    inp = tmp_path / "in.parquet"
    ids = [f"r{i}" for i in range(len(SHORT))]
    pq.write_table(pa.table({"id": ids, "document": SHORT}), inp)
    return inp, ids


def test_ctrl_c_and_sigkill_stop_a_job_with_its_rows_kept_and_no_ray_left(tmp_path):
    """Ctrl-C (SIGINT to the process group): exit 130, one warning line, no traceback or
    ERROR line, the finished rows kept and no process of the job's Ray left. SIGKILL of the
    job, going on from those rows: the rows it wrote stay, every id once, and within seconds
    no process of its Ray is left (GCS, raylet, dashboard, agents, workers)."""
    inp, ids = _input(tmp_path)
    out = tmp_path / "out"
    first = _start_and_stop(inp, out, signal.SIGINT)
    _stopped_cleanly(first, 130, "interrupted (SIGINT)")
    kept = rows_of(out)
    assert 1 <= len(kept) < len(ids)
    second, session = _start(inp, out)
    second.kill()  # SIGKILL, to the job alone
    second.communicate(timeout=120)
    assert second.returncode == -signal.SIGKILL
    assert _gone(session, 30) == []
    table = pq.read_table(out / "rows")
    written = table.column("id").to_pylist()
    assert len(written) == len(set(written)) and set(kept) < set(written)  # each id once
    assert all(e is None for e in table.column("error").to_pylist())


@pytest.mark.e2e
def test_sigterm_to_the_group_stops_a_job_as_ctrl_c_does(tmp_path):
    """SIGTERM to the process group (``timeout``, a scheduler's cancel, a container stop):
    the same handler as Ctrl-C's, so the same clean stop with exit 143; the job's Ray, in a
    session of its own, does not hear it (no wait on a GCS the signal ended)."""
    inp, ids = _input(tmp_path)
    out = tmp_path / "out"
    stopped = _start_and_stop(inp, out, signal.SIGTERM)
    _stopped_cleanly(stopped, 143, "terminated (SIGTERM)")
    assert 1 <= len(rows_of(out)) < len(ids)


@pytest.mark.e2e
def test_a_non_utf8_prompt_file_is_one_error_line(tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"\xff\xfe bad")
    proc = knapspec("generate", "--prompt-file", str(bad), "--max-new-tokens", "2")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and str(bad) in errors[0] and "not valid UTF-8" in errors[0], errors
