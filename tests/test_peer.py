"""``knapspec peer``: the same job through our engine and a peer, side by side. vLLM itself is
not installed here; a stand-in interpreter answers its half of the protocol (vllm_side.py's
request and result files), so the command's plumbing, timing and comparison run for real."""

from __future__ import annotations

import json
import stat
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from knapspec_dist.cli.main import main
from knapspec_dist.errors import UserError
from knapspec_dist.jobs.options import DEFAULT_INSTRUCTION
from knapspec_dist.tools.peer.compare import (
    PeerJob,
    compare,
    mean_run,
    phases,
    read_job,
    table,
)

# Answers as vllm_side.py would, with the tokens of the file named by its environment.
STAND_IN = """#!/bin/sh
exec {python} -c '
import json, os, sys
req = json.load(open(sys.argv[2]))
tokens = json.load(open(os.environ["PEER_TOKENS"]))
k = (req["ngram"] or [0])[0]  # n-gram drafts of K tokens: K/10 s faster
json.dump({{"startup_s": 9.0, "prefill_s": 2.0, "full_s": 3.0 - k / 10, "tokens": tokens,
           "decode_window_s": 0.5, "decode_window_tokens": 2,
           "versions": {{"vllm": "stand-in", "torch": "-"}}, "threads": req["threads"]}},
          open(sys.argv[3], "w"))' "$@"
"""


@pytest.fixture
def documents(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "document": [
        "The river rose all night and by morning the village was an island.",
        "She counted the coins twice, then a third time, and still one was missing."]}), path)
    return path


def stand_in(tmp_path):
    exe = tmp_path / "python"
    exe.write_text(STAND_IN.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_peer_runs_both_engines_on_the_same_prompts_and_counts_identical_rows(
        smollm2, documents, tmp_path, monkeypatch, capsys):
    job = read_job(str(documents), str(smollm2.path), id_column="id", text_column="document",
                   instruction=DEFAULT_INSTRUCTION, dtype="fp32", threads=1,
                   max_model_len=2048, max_num_seqs=4, new_tokens=3)
    assert len(job.prompts) == 2 and job.prompt_tokens > 30
    peer_tokens = tmp_path / "tokens.json"
    peer_tokens.write_text(json.dumps([[1, 2, 3], [4, 5, 6]]))  # first pass: not ours
    monkeypatch.setenv("PEER_TOKENS", str(peer_tokens))
    out = tmp_path / "out"
    args = ["peer", "--input", str(documents), "--threads", "1", "--new-tokens", "3",
            "--max-model-len", "2048", "--max-num-seqs", "4",
            "--vllm-python", str(stand_in(tmp_path)), "--out", str(out)]
    assert main(args + ["--vllm-ngram", "none"]) == 0  # plain vLLM alone
    first = json.loads((out / "peer.json").read_text())
    assert "vllm_ngram" not in first
    ours = first["tokens"]["ar"]
    assert first["ours"]["ar"]["identical_to_vllm"] == 0 and len(ours) == 2
    assert first["vllm"]["startup_s"] == 9.0 and first["vllm"]["decode_tokens_per_s"] == 4.0
    assert first["ours"]["ar"]["speed_vs_vllm"]["startup_s"] > 0
    window = first["ours"]["ar"]  # 3 new tokens a row, 2 rows: up to 4 after the first ones
    assert 0 <= window["decoded"] <= 4 and 0 <= window["decode_s"] <= window["end_to_end_s"]
    peer_tokens.write_text(json.dumps([ours[0], [4, 5, 6]]))  # the peer agrees on one row
    assert main(args) == 0
    second = json.loads((out / "peer.json").read_text())
    assert second["ours"]["ar"]["identical_to_vllm"] == 1
    assert "| rows token-identical to vLLM | - | 1/2 |" in capsys.readouterr().out
    assert "stand-in" in (out / "peer.md").read_text()
    ngram = second["vllm_ngram"]  # the default sweep, 2:3 and 4:3; 4:3 the fastest
    assert list(ngram["runs"]) == ["2:3", "4:3"] and ngram["best"] == "4:3"
    assert ngram["runs"]["4:3"]["end_to_end_s"] == pytest.approx(2.6)
    mine = second["ours"]["ar"]
    assert mine["speed_vs_vllm_ngram"]["end_to_end_s"] == pytest.approx(
        2.6 / mine["end_to_end_s"])
    assert "| 4:3 (fastest) |" in (out / "peer.md").read_text()
    assert main(args + ["--vllm-ngram", "4"]) == 2


def test_a_row_the_job_would_fail_fails_the_comparison(smollm2, documents):
    with pytest.raises(UserError, match="row 0 .*id 'a'.*context window of 20"):
        read_job(str(documents), str(smollm2.path), id_column="id", text_column="document",
                 instruction=DEFAULT_INSTRUCTION, dtype="fp32", threads=1, max_model_len=20,
                 max_num_seqs=4, new_tokens=3)


def test_a_missing_peer_venv_is_a_user_error(documents, tmp_path, capsys):
    code = main(["peer", "--input", str(documents), "--vllm-python",
                 str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    assert code == 2 and "make vllm-venv" in capsys.readouterr().err


def test_phases_split_prefill_and_decode_and_speed_is_the_peers_time_over_ours():
    """Decode is the full run's window after every row's first token; its speed is our rate
    over the peer's, the other phases' the peer's time over ours."""
    p = phases(10.0, 4.0, 6.0, [[1, 2, 3], [1]], prompt_tokens=400, decode_s=2.0, decoded=1)
    assert (p["decode_s"], p["prefill_tokens_per_s"], p["decode_tokens_per_s"]) == (2.0, 100, 0.5)
    job = PeerJob("m", "fp32", 2, 64, 4, 3, ["a", "b"], [[7] * 10, [8] * 30])
    vllm = {"startup_s": 60.0, "prefill_s": 4.0, "full_s": 6.0, "tokens": [[1, 2, 3], [1]],
            "decode_window_s": 2.0, "decode_window_tokens": 2}
    ours = {"startup_s": 20.0, "prefill_s": 8.0,
            "runs": {"ar": {"s": 10.0, "tokens": [[1, 2, 3], [2]], "decode_window_s": 1.0,
                            "decode_window_tokens": 2}}}
    result = compare(job, ours, vllm)
    speed = result["ours"]["ar"]["speed_vs_vllm"]
    assert speed == {"startup_s": 3.0, "prefill_s": 0.5, "decode_s": 2.0, "end_to_end_s": 0.6}
    assert result["ours"]["ar"]["identical_to_vllm"] == 1
    assert "| end to end | 6.0 s | 10.0 s | 0.60x |" in table(job, result)


def test_repeats_are_reported_as_their_mean_and_against_our_ar():
    """Interleaved repeats of one strategy count as their mean, so its ratio to ``ar`` is
    that of their sums; the runs that gave other tokens than the first are counted."""
    copy = {"plan": "copy@<=3", "rows": 1, "rounds": 3, "tokens": 5, "tokens_per_s": 2.5,
            "predicted_tokens_per_s": None}
    runs = [{"s": s, "tokens": t, "decode_window_s": d, "decode_window_tokens": 90,
             "work": {}, "plans": [copy]} for s, d, t in ((10.0, 6.0, [[1]]), (14.0, 10.0, [[1]]),
                                         (12.0, 8.0, [[2]]))]
    mean = mean_run(runs)
    assert (mean["s"], mean["decode_window_s"], mean["decode_window_tokens"]) == (12.0, 8.0, 90)
    assert (mean["runs_s"], mean["runs_identical"]) == ([10.0, 14.0, 12.0], 2)
    job = PeerJob("m", "fp32", 2, 64, 4, 3, ["a"], [[7] * 10])
    vllm = {"startup_s": 60.0, "prefill_s": 4.0, "full_s": 6.0, "tokens": [[1]],
            "decode_window_s": 2.0, "decode_window_tokens": 2}
    ar = mean_run([dict(runs[0], s=15.0, decode_window_s=9.0)])
    result = compare(job, {"startup_s": 1.0, "prefill_s": 1.0,
                           "runs": {"ar": ar, "knapspec": mean}}, vllm)
    assert result["ours"]["knapspec"]["speed_vs_ar"] == {"end_to_end_s": 1.25,
                                                          "decode_s": 9.0 / 8.0}
    assert "| runs (interleaved), seconds each, same tokens | - | 1: 15; 1/1 | - | " \
           "3: 10, 14, 12; 2/3 | - |" in table(job, result)
    assert "| knapspec | copy@<=3 | 3 | 5 | 2.5 | - |" in table(job, result)
