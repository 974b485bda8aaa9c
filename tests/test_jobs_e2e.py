"""Batch jobs on a real local Ray head, with the real engine and SmolLM2.

One head per module, started and stopped by ``cluster/local.sh`` (token auth, its own
ports and temp dir, so it never meets another Ray on the machine).  The jobs go through
``ray job submit`` with ``cluster/runtime_env.yaml``, as users submit them:

* end to end: a small Parquet (four short documents and three bad rows), knapspec; every
  output row, the baseline row, summary.json and speedup.png are checked;
* resume: a job stopped after two rows (``--stop-after``), then submitted again to the same
  output directory; the first two rows are neither recomputed nor rewritten;
* malformed input files fail fast, with one clear line, before any model loads;
* fault: a driver kills the shard actor's process (SIGKILL) right after the first row, while
  the next row is in flight; the replica is restarted and the output is complete, once.

Small on purpose: at most 8 new tokens, prompts of 100-500 tokens, one replica.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import matplotlib.image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from knapspec_dist.tools.corpus import bundled_sample_path

pytestmark = pytest.mark.processes  # a Ray head and jobs on it

REPO = Path(__file__).resolve().parent.parent
LOCAL_SH = REPO / "cluster" / "local.sh"
JOB_TIMEOUT = 900  # seconds; generous for a loaded 2-core CI machine


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class Head:
    def __init__(self, env: dict, gcs: str):
        self.env, self.gcs = env, gcs

    def submit(self, *job_args: str, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:
        """``ray job submit`` of jobs/summarize.py; waits and returns the CLI's output."""
        cmd = ["ray", "job", "submit", "--runtime-env", "cluster/runtime_env.yaml", "--",
               "python", "jobs/summarize.py", *job_args]
        return subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def python(self, code: str, *args: str, timeout: float = JOB_TIMEOUT):
        """Run ``code`` in a fresh Python (a driver of this cluster)."""
        return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def head():
    state = Path(tempfile.mkdtemp(prefix="ksj", dir="/tmp"))  # short: Ray's socket paths
    gcs, dash, client, agent = _free_ports(4)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") or k in ("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES",)}
    env.update(KNAPSPEC_RAY_DIR=str(state), RAY_PORT=str(gcs), RAY_DASHBOARD_PORT=str(dash),
               RAY_CLIENT_PORT=str(client), RAY_AGENT_PORT=str(agent), RAY_NUM_CPUS="2",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    started = subprocess.run([str(LOCAL_SH), "start"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert started.returncode == 0, started.stdout + started.stderr
    client_env = dict(env)
    for line in (state / "env.sh").read_text().splitlines():
        m = re.fullmatch(r"export (\w+)=(\S*).*", line)
        if m:
            client_env[m.group(1)] = m.group(2)
    assert client_env["RAY_AUTH_MODE"] == "token"
    try:
        yield Head(client_env, f"127.0.0.1:{gcs}")
    finally:
        subprocess.run([str(LOCAL_SH), "stop"], env=env, capture_output=True, timeout=180)
        shutil.rmtree(state, ignore_errors=True)


def _words(n: int, offset: int = 0) -> str:
    text = pq.read_table(bundled_sample_path(), columns=["document"]).column(0)[1].as_py()
    return " ".join(text.split()[offset:offset + n])


def _good_docs() -> dict[str, str]:
    """Four short documents of different lengths (about 100-450 tokens of prompt)."""
    return {"tiny": _words(60), "short": _words(120, 60), "mid": _words(220, 180),
            "long": _words(320, 400)}


def _rows(out: Path, sub: str = "rows") -> list[dict]:
    return pq.read_table(out / sub).to_pylist()


# `make test` leaves this to `make test-e2e` (CI runs both): faster tests cover all of it but
# `ray job submit` with cluster/runtime_env.yaml. Knapspec rows of SmolLM2 from a replica, token
# for token plain ar decoding, and a row past the window as its error: test_processor.py's
# test_processor_chains_with_the_users_maps_on_items_and_parquet. A job of the real engine over
# Ray, every row written once: test_multinode.py. A job's rows, null and empty rows' errors,
# baseline rows (the strategy's, then ar's), summary.json and speedup.png: test_jobs.py's
# test_job_writes_one_row_per_input_row_summary_and_plot and
# test_rows_with_null_empty_or_too_long_text_get_an_error, test_summary_stream.py,
# test_job_report.py. The command line behind jobs/summarize.py: test_bad_setups.py.
@pytest.mark.e2e
def test_ray_job_submit_end_to_end(head, tmp_path):
    docs = _good_docs()

    sample = pq.read_table(bundled_sample_path(), columns=["document"]).column(0).to_pylist()
    too_long = "\n\n".join(sample[:3])  # ~9.3k tokens: over SmolLM2's 8192-token window
    ids = [*docs, "null-doc", "blank-doc", "too-long"]
    pq.write_table(pa.table({"id": ids, "book": ["x"] * len(ids),
                             "document": [*docs.values(), None, "  \n ", too_long]}),
                   tmp_path / "in.parquet")
    out = tmp_path / "out"
    run = head.submit("--input", str(tmp_path / "in.parquet"), "--output", str(out),
                      "--model", "smollm2", "--strategy", "knapspec", "--max-new-tokens", "8",
                      "--baseline-fraction", "0.25", "--progress-seconds", "5",
                      "--long-documents", "fail")  # trees: test_tree.py, test_processor.py
    log = run.stdout + run.stderr
    assert run.returncode == 0 and re.search(r"Job '\S+' succeeded", log), log[-5000:]
    # the progress line reached the job's log, its rows counted as the report counts them
    assert "rows: 7/7 rows (3 failed)" in log

    rows = {r["id"]: r for r in _rows(out)}
    assert sorted(rows) == sorted(ids) and len(_rows(out)) == len(ids)  # each row once
    for key in docs:
        r = rows[key]
        assert r["error"] is None, r["error"]
        assert r["strategy"] == "knapspec" and r["generated_text"].strip()
        assert 1 <= r["num_generated_tokens"] == len(r["generated_tokens"]) <= 8
        assert 60 < r["num_input_tokens"] < 700
        assert r["time_taken_llm"] > 0 and r["tokens_per_s"] > 0
        assert r["finish_reason"] in ("eos", "length") and r["attempts"] == 1
        assert 0 <= r["accepted"] <= r["drafted"]
    lengths = sorted(rows[k]["num_input_tokens"] for k in docs)
    assert lengths == [rows[k]["num_input_tokens"] for k in ("tiny", "short", "mid", "long")]
    assert rows["null-doc"]["error"] == "'document' is null"
    assert rows["blank-doc"]["error"] == "'document' is empty"
    assert "context window of 8192 tokens" in rows["too-long"]["error"]
    assert rows["too-long"]["num_input_tokens"] > 8192
    assert all(rows[k]["generated_text"] is None for k in ("null-doc", "blank-doc", "too-long"))

    # the baseline: ceil(0.25 * 4) = 1 row, the median length, run again with the job's
    # strategy and then with ar
    base, again = _rows(out, "baseline"), _rows(out, "baseline_strategy")
    assert len(base) == 1 and base[0]["strategy"] == "ar" and base[0]["error"] is None
    assert len(again) == 1 and again[0]["strategy"] == "knapspec" and again[0]["error"] is None
    assert base[0]["id"] == again[0]["id"] == "short"  # valid rows: tiny, short, mid, long
    assert base[0]["generated_tokens"] == rows[base[0]["id"]]["generated_tokens"]  # lossless
    assert again[0]["generated_tokens"] == base[0]["generated_tokens"]

    s = json.loads((out / "summary.json").read_text())
    assert s["complete"] is True
    assert s["rows"] == {"input": 7, "written": 7, "ok": 4, "failed": 3, "pending": 0,
                         "not_in_input": 0, "generations": 4, "document_paths": {"whole": 4}}
    assert s["tokens"]["generated"] == sum(rows[k]["num_generated_tokens"] for k in docs)
    assert s["row_tokens_per_s"] > 0
    t = s["throughput"]
    assert t["tokens_per_s"] > 0 and t["decode_tokens_per_s"] >= t["tokens_per_s"]
    assert t["max_num_seqs"] >= 1 and 1 <= t["mean_batch"] <= t["max_num_seqs"]
    b = s["baseline"]
    assert b["rows"] == 1 and b["identical_tokens"] == 1 and b["speedup"] > 0
    assert b["strategy_mean_batch"] == b["ar_mean_batch"] == 1.0  # one row: like with like
    assert b["speedup"] == pytest.approx(  # one row: its rate in the two baseline passes
        (again[0]["num_generated_tokens"] / again[0]["time_taken_llm"])
        / (base[0]["num_generated_tokens"] / base[0]["time_taken_llm"]), rel=0.05)
    assert [x["bucket"] for x in s["buckets"]] == ["0-512", "8k-16k"]
    assert s["buckets"][0]["ok"] == 4 and s["buckets"][1]["failed"] == 1
    assert s["job"]["strategy"] == "knapspec" and s["run"]["rows_generated"] == 4

    png = matplotlib.image.imread(out / "speedup.png")
    assert png.shape[0] > 400 and png.shape[1] > 400


@pytest.mark.e2e
def test_stopped_job_resumes_without_recomputing_finished_rows(head, tmp_path):
    docs = _good_docs()
    pq.write_table(pa.table({"id": list(docs), "document": list(docs.values())}),
                   tmp_path / "in.parquet")
    out = tmp_path / "out"
    args = ["--input", str(tmp_path / "in.parquet"), "--output", str(out),
            "--strategy", "static", "--skip", "a10,a12,m14,a16", "--max-new-tokens", "8",
            "--baseline-fraction", "0", "--checkpoint-rows", "1"]
    first = head.submit(*args, "--stop-after", "2")
    assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
    assert "stopped early (--stop-after)" in first.stdout
    done = {r["id"]: r for r in _rows(out)}
    assert sorted(done) == ["long", "mid"]  # longest first
    partial = json.loads((out / "summary.json").read_text())
    assert not partial["complete"] and partial["rows"]["pending"] == 2
    parts = {p.name: p.read_bytes() for p in (out / "rows").glob("part-*.parquet")}

    second = head.submit(*args)
    log = second.stdout + second.stderr
    assert second.returncode == 0, log[-5000:]
    assert "2 of 4 rows already written, 2 to go" in log
    rows = _rows(out)
    assert sorted(r["id"] for r in rows) == sorted(docs)  # complete, each id once
    for name, data in parts.items():  # the first run's parts are untouched
        assert (out / "rows" / name).read_bytes() == data
    again = {r["id"]: r for r in rows}
    for key, r in done.items():  # same row, same finish time: not recomputed
        assert again[key]["finished_at"] == r["finished_at"]
        assert again[key]["time_taken_llm"] == r["time_taken_llm"]
    s = json.loads((out / "summary.json").read_text())
    assert s["complete"] and s["run"]["rows_skipped"] == 2 and s["run"]["rows_generated"] == 2
    assert s["rows"]["ok"] == 4


@pytest.mark.e2e
def test_malformed_inputs_fail_fast_under_ray_job_submit(head, tmp_path):
    cases = {
        "missing-column": (pa.table({"id": ["a"], "body": ["x"]}),
                           "missing column 'document'; it has id, body"),
        "duplicate-ids": (pa.table({"id": ["a", "b", "a"], "document": ["x", "y", "z"]}),
                          "1 duplicate 'id' value(s), e.g. 'a'"),
        "no-rows": (pa.table({"id": pa.array([], pa.string()),
                              "document": pa.array([], pa.string())}), "no rows"),
        "not-parquet": (None, "is not a readable Parquet file"),
    }
    inputs = {}
    for name, (table, _) in cases.items():
        path = tmp_path / f"{name}.parquet"
        if table is None:
            path.write_text("id,document\na,some text\n")
        else:
            pq.write_table(table, path)
        inputs[name] = str(path)
    # All four at once through the job API (the same client `ray job submit` uses).
    code = textwrap.dedent("""
        import json, sys, time
        from ray.job_submission import JobStatus, JobSubmissionClient
        client = JobSubmissionClient()
        inputs, out = json.loads(sys.argv[1]), sys.argv[2]
        ids = {name: client.submit_job(
                   entrypoint=f"python jobs/summarize.py --input {path} --output {out}/{name}",
                   runtime_env={"working_dir": "."})
               for name, path in inputs.items()}
        done = {}
        while len(done) < len(ids):
            for name, jid in ids.items():
                status = client.get_job_status(jid)
                if name not in done and status.is_terminal():
                    done[name] = {"status": str(status), "logs": client.get_job_logs(jid)}
            time.sleep(0.5)
        print(json.dumps(done))
    """)
    run = head.python(code, json.dumps(inputs), str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr[-5000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for name, (_, message) in cases.items():
        status, logs = results[name]["status"], results[name]["logs"]
        assert status.endswith("FAILED"), (name, logs)
        errors = [line for line in logs.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and message in errors[0], (name, logs)
        assert "Traceback" not in logs, (name, logs)
        # failed before the engine started: no actor, no weights, no output directory
        assert "generating" not in logs and "loaded" not in logs, (name, logs)
        assert not (tmp_path / "out" / name).exists()


FAULT_DRIVER = textwrap.dedent("""
    import json, logging, os, signal, sys
    from ray.util.state import list_actors
    from knapspec_dist.jobs import JobConfig, run_job
    from knapspec_dist.speculation.options import StrategyOptions

    logging.basicConfig(level=logging.INFO)
    killed = []

    def kill_a_shard(row):
        # Right after the first row finished, the others are in the replica's batch.
        if killed or row["error"] is not None:
            return
        shards = list_actors(filters=[("state", "=", "ALIVE"), ("class_name", "=", "Shard")])
        assert len(shards) == 1, shards
        os.kill(shards[0].pid, signal.SIGKILL)
        killed.append({"name": shards[0].name, "pid": shards[0].pid})

    inp, out, address = sys.argv[1:4]
    result = run_job(JobConfig(
        input=inp, output=out, address=address, model="smollm2",
        strategy=StrategyOptions(name="static", skip="a10,a12,m14,a16"), max_new_tokens=8,
        baseline_fraction=0, checkpoint_rows=1, max_num_seqs=8, progress_seconds=5),
        on_row=kill_a_shard)
    alive = list_actors(filters=[("state", "=", "ALIVE"), ("class_name", "=", "Shard")])
    print(json.dumps({"killed": killed, "summary": result.summary,
                      "alive_after": [a.pid for a in alive]}))
""")


@pytest.mark.e2e
def test_killed_shard_actor_is_replaced_and_no_row_is_lost_or_duplicated(head, tmp_path):
    """16 rows through a replica decoding 8 at once; its shard is SIGKILLed mid-job."""
    docs = {f"{key}-{i}": f"{text} ({i})" for i in range(4) for key, text in _good_docs().items()}
    pq.write_table(pa.table({"id": list(docs), "document": list(docs.values())}),
                   tmp_path / "in.parquet")
    out = tmp_path / "out"
    run = head.python(FAULT_DRIVER, str(tmp_path / "in.parquet"), str(out), head.gcs)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-5000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(report["killed"]) == 1
    assert "restarting it and retrying its rows" in log
    rows = _rows(out)
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted(docs) and len(ids) == len(set(ids))  # complete, no duplicate
    assert all(r["error"] is None and r["num_generated_tokens"] >= 1 for r in rows)
    retried = [r for r in rows if r["attempts"] >= 2]
    assert retried, rows  # the row in flight when the shard died ran again
    s = report["summary"]
    assert s["complete"] and s["rows"]["ok"] == 16
    assert s["run"]["replica_restarts"] == 1 and s["run"]["row_retries"] >= 1
    t = s["throughput"]
    assert t["max_num_seqs"] == 8 and t["mean_batch"] > 1 and t["tokens_per_s"] > 0
    assert report["alive_after"] == []  # the engine shut its (restarted) replica down
