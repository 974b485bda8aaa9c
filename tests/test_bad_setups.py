"""A new user's bad setups, run as the user runs them: ``jobs/summarize.py`` and
``knapspec generate`` in a fresh process.  Each ends with exit 2 and one ``error:`` line (no
traceback), or is handled as described, and a job's rows on disk are exactly what they
should be: never mixed with another job's, never blocked by a failed start.

``C`` is ``--strategy ar --max-new-tokens 8 --baseline-fraction 0``: the cheapest job.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from knapspec_dist.cli.job import main as job_main
from knapspec_dist.cli.main import main as knapspec_main
from knapspec_dist.model.embedded import resolve_model_path

from conftest import subprocess_env

pytestmark = pytest.mark.processes  # CLI commands, some on a Ray of their own

REPO = Path(__file__).resolve().parent.parent
C = ["--strategy", "ar", "--max-new-tokens", "8", "--baseline-fraction", "0"]
PROFILE = next((REPO / "profiles").glob("*layers30-hidden576*__eager.json"))


def summarize(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "jobs/summarize.py", *args], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def knapspec(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "knapspec_dist.cli.main", *args], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def in_process(capsys, command, *args: str) -> subprocess.CompletedProcess:
    """``command`` (``knapspec`` or ``summarize.py``) run by its ``main`` in this process, as
    a CompletedProcess: for the refusals made before any Ray starts, where a fresh
    interpreter would add only its start-up; each command still has subprocess cases here."""
    rc = knapspec_main(list(args)) if command == "knapspec" else job_main(list(args))
    out, err = capsys.readouterr()
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "refused only after Ray started"
    return subprocess.CompletedProcess([command, *args], rc, out, err)


def one_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, no traceback, exactly one ``error:`` line containing every fragment."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1, proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def write_input(path: Path, ids: list[str], docs: list[str]) -> str:
    pq.write_table(pa.table({"id": ids, "document": docs}), path)
    return str(path)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def rows_on_disk(out: Path) -> list[dict]:
    return pq.read_table(out / "rows").to_pylist()


# ----------------------------------------------------------------------------- jobs

@pytest.mark.e2e
def test_failed_starts_leave_no_identity_and_another_input_is_refused(tmp_path, capsys):
    """Cases 2, 1 and 8: a failed start (bad --model, --gamma 0) blocks nothing; the corrected
    job runs; the same output folder then refuses another input and stays untouched; the
    summary groups the over-long rows under one kind.  A row of invalid UTF-8
    (Parquet does not check a string column's bytes) is that row's error alone."""
    short = "The cat sat on the mat. It was a sunny day and the cat was happy."
    texts = [short, short + " The end.", "word " * 300, "word " * 450]
    docs = pa.array([t.encode() for t in texts] + [b"\xff\xfe bad"], pa.binary())
    a = str(tmp_path / "A.parquet")
    pq.write_table(pa.table({"id": ["a1", "a2", "a3", "a4", "a5"],
                             "document": docs.view(pa.string())}), a)
    with pytest.raises(UnicodeDecodeError):  # what crashed the job before
        pq.read_table(a).column("document").to_pylist()
    b = write_input(tmp_path / "B.parquet", ["b1", "b2"], [short, short])
    out = tmp_path / "OUT"
    base = ["--input", a, "--output", str(out), *C, "--max-model-len", "256",
            "--long-documents", "fail", "--address", "local"]  # over-long rows: errors

    one_error(in_process(capsys, "summarize", *base, "--model", "/nonexistent"), "/nonexistent")
    assert not (out / "job.json").exists()
    one_error(in_process(capsys, "summarize", *base, "--gamma", "0"),
              "--gamma must be an integer in 1..")
    assert not (out / "job.json").exists()

    done = summarize(*base)  # the corrected command: not refused
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "rows: 2 ok, 3 failed" in done.stdout, done.stdout
    rows = {r["id"]: r for r in rows_on_disk(out)}
    assert set(rows) == {"a1", "a2", "a3", "a4", "a5"}
    assert rows["a1"]["error"] is None and rows["a1"]["num_generated_tokens"] >= 1
    assert rows["a2"]["error"] is None
    assert rows["a3"]["error"] and rows["a4"]["error"]
    assert rows["a5"]["error"].startswith("'document' is not valid UTF-8: invalid start byte")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"]["input"] == 5 and summary["rows"]["ok"] == 2
    assert summary["errors"] == {"prompt too long for the context window": 2,  # case 8
                                 "'document' is not valid UTF-8": 1}

    before = snapshot(out)
    refused = in_process(capsys, "summarize", "--input", b, "--output", str(out), *C,
                         "--max-model-len", "256", "--address", "local")
    one_error(refused, "holds rows of a different job", "input", "B.parquet")
    assert snapshot(out) == before  # the existing output is untouched
    assert sorted(r["id"] for r in rows_on_disk(out)) == ["a1", "a2", "a3", "a4", "a5"]


@pytest.mark.parametrize("where", ["file", "proc"])
def test_an_unwritable_output_is_one_error_line(tmp_path, capsys, where):
    """Case 3: an output path under a regular file, or where not even root may write."""
    a = write_input(tmp_path / "A.parquet", ["a1"], ["Some text."])
    if where == "file":
        (tmp_path / "plain.txt").write_text("x")
        out = tmp_path / "plain.txt" / "OUT"
    else:
        out = Path("/proc/knapspec-test-output/OUT")
    one_error(in_process(capsys, "summarize", "--input", a, "--output", str(out), *C),
              "--output", "cannot write")
    if where == "file":
        assert (tmp_path / "plain.txt").read_text() == "x"


def test_a_kv_cache_too_small_for_one_row_is_refused_before_ray(tmp_path, capsys):
    """A --kv-cache-memory that holds no row of --max-model-len: one line naming both token
    counts, before any Ray or replica starts, and the output folder untouched."""
    a = write_input(tmp_path / "A.parquet", ["a1"], ["Some text."])
    out = tmp_path / "OUT"
    proc = in_process(capsys, "summarize", "--input", a, "--output", str(out), *C,
                      "--max-model-len", "1024", "--kv-cache-memory", "1MiB")
    # SmolLM2 fp32: 46,080 bytes a position, so 1 MiB is one page of 16 positions: the
    # scratch page, leaving none for rows
    one_error(proc, "the KV cache holds 0 tokens per rank (--kv-cache-memory 1048576 bytes "
              "(1.0 MiB))",
              "one row of --max-model-len 1024 needs 1042 tokens")
    assert not (out / "job.json").exists()


@pytest.fixture(scope="module")
def corrupt_model(tmp_path_factory) -> Path:
    """SmolLM2's folder with garbage in model.safetensors."""
    source = resolve_model_path("smollm2")
    folder = tmp_path_factory.mktemp("corrupt")
    for f in source.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    return folder


@pytest.mark.e2e
def test_corrupt_weights_are_one_error_line_naming_the_file(tmp_path, corrupt_model):
    """Case 6, from ``knapspec generate`` and from the job (before any Ray starts)."""
    name = str(corrupt_model / "model.safetensors")
    one_error(knapspec("generate", "--model", str(corrupt_model), "--prompt", "Hi",
                       "--strategy", "ar", "--max-new-tokens", "2"), name)
    a = write_input(tmp_path / "A.parquet", ["a1"], ["Some text."])
    out = tmp_path / "OUT"
    one_error(summarize("--input", a, "--output", str(out), *C, "--model", str(corrupt_model)),
              name)
    assert not (out / "job.json").exists()


@pytest.mark.e2e
def test_cuda_on_a_cluster_without_gpus_fails_in_seconds(tmp_path):
    """Case 7: the job checks the cluster's GPUs before waiting for a placement group."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    a = write_input(tmp_path / "A.parquet", ["a1"], ["Some text."])
    out = tmp_path / "OUT"
    start = time.monotonic()
    proc = summarize("--input", a, "--output", str(out), *C, "--device", "cuda", "--tp", "1",
                     "--replicas", "2", "--address", "local")
    one_error(proc, "needs 2 GPU(s)", "has 0")
    assert time.monotonic() - start < 200  # a local Ray start on a busy machine, not 300 s
    assert not (out / "job.json").exists()
    assert not list((out / "rows").glob("*.parquet"))


# ----------------------------------------------------------------------------- profiles

def _edited_profile(tmp_path: Path, edit) -> str:
    data = json.loads(PROFILE.read_text())
    data = edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))  # json writes NaN for float("nan")
    return str(path)


@pytest.mark.parametrize("edit, message", [
    (lambda d: [], "expected a JSON object"),
    (lambda d: None, "expected a JSON object"),
    (lambda d: {**d, "attention": "fast"}, "'attention' must be an object"),
    (lambda d: {**d, "mlp": float("nan")}, "'mlp' must be a finite number"),
    (lambda d: {**d, "verify": {"1": {"slope": 0, "intercept": None}}}, "verify.1.intercept"),
])
def test_a_malformed_profile_is_one_error_line(tmp_path, capsys, edit, message):
    """Case 4: checked completely when loaded, before any generation (the next test runs
    ``knapspec generate --profile`` in its own process)."""
    path = _edited_profile(tmp_path, edit)
    one_error(in_process(capsys, "knapspec", "generate", "--prompt", "Hi", "--strategy",
                         "knapspec", "--profile", path, "--max-new-tokens", "4"),
              "is malformed", message)


@pytest.mark.e2e
def test_a_profile_of_another_model_shape_is_refused(tmp_path):
    """Case 5: the committed profile edited to 4 layers cannot price the 30-layer SmolLM2."""
    path = _edited_profile(tmp_path, lambda d: {**d, "model": {**d["model"], "layers": 4}})
    one_error(knapspec("generate", "--prompt", "Hi", "--strategy", "knapspec", "--profile",
                       path, "--max-new-tokens", "4"),
              "another model shape", "layers: 4 (profile) vs 30 (model)")
    a = write_input(tmp_path / "A.parquet", ["a1"], ["Some text."])
    out = tmp_path / "OUT"
    one_error(summarize("--input", a, "--output", str(out), "--strategy", "knapspec",
                        "--profile", path, "--max-new-tokens", "8"), "another model shape")
    assert not (out / "job.json").exists()
