"""Seeded sampling reproduces, run as the user runs it: real jobs and
``knapspec generate`` on SmolLM2 at temperature 0.8 (the jobs in fresh processes).

A row's tokens depend only on its prompt, the options and the seed: not on the rows batched
beside it (``--max-num-seqs``), the replica that ran it (``--replicas``), the order rows were
admitted in, or a resume. The strategy is ``static`` (speculation with rejections, no profile
to measure), whose sampled tokens are also plain sampling's (engine/sampling.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from knapspec_dist.cli.main import main

from conftest import subprocess_env

REPO = Path(__file__).resolve().parent.parent
SAMPLED = ["--temperature", "0.8", "--seed", "7", "--max-new-tokens", "12"]
JOB = [*SAMPLED, "--strategy", "static", "--skip", "a3,m5,a7,m9,a11", "--gamma", "3",
       "--baseline-fraction", "0", "--no-progress-bar", "--checkpoint-rows", "1"]
DOCS = ["The rain fell on the old town all night.", "A letter came for Miss Bennet today.",
        "He walked to the harbour and watched the boats.", "The garden was full of roses.",
        "Nobody in the village knew the stranger's name.", "The ball ended after midnight."]


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "knapspec_dist.cli.main", *args], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def rows(out: Path) -> dict[str, list[int]]:
    table = pq.read_table(out / "rows").to_pylist()
    assert all(r["error"] is None for r in table), [r["error"] for r in table]
    return {r["id"]: list(r["generated_tokens"]) for r in table}


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("input") / "docs.parquet"
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(len(DOCS))], "document": DOCS}), path)
    return str(path)


@pytest.mark.e2e
@pytest.mark.processes  # CLI jobs, each with a Ray of its own
def test_seeded_job_rows_do_not_depend_on_batching_replicas_or_resume(docs, tmp_path):
    """The same seeded job two ways, the same rows: one row at a time over two replicas, and
    four rows batched on one replica, stopped after two rows and resumed."""
    job = ["job", "--input", docs]
    run(*job, "--output", str(tmp_path / "b"), *JOB, "--max-num-seqs", "1", "--replicas", "2")
    first = rows(tmp_path / "b")
    assert len(first) == len(DOCS) and len({tuple(v) for v in first.values()}) == len(DOCS)
    run(*job, "--output", str(tmp_path / "c"), *JOB, "--max-num-seqs", "4", "--stop-after", "2")
    assert len(rows(tmp_path / "c")) == 2
    run(*job, "--output", str(tmp_path / "c"), *JOB, "--max-num-seqs", "4")  # resumed
    assert rows(tmp_path / "c") == first  # batched, resumed mid-job: the same rows


def test_seeded_generate_of_a_prompt_ignores_the_prompts_beside_it(capsys):
    """In this process, one call after the other (the second starts from the first's global
    random state: only the seed may decide); the job runs above are the fresh processes."""
    a, b = DOCS[0], DOCS[1]
    assert main(["generate", "--prompt", a, "--chat", "--json", *SAMPLED, "--strategy",
                 "ar"]) == 0
    alone = capsys.readouterr().out
    assert main(["generate", "--prompt", b, "--prompt", a, "--chat", "--json", *SAMPLED,
                 "--strategy", "static", "--skip", "a3,m5", "--gamma", "3"]) == 0
    beside = capsys.readouterr().out
    text_alone = json.loads(alone.splitlines()[0])["text"]
    assert text_alone.strip()
    assert json.loads(beside.splitlines()[1])["text"] == text_alone


@pytest.mark.e2e
@pytest.mark.processes  # CLI jobs, each with a Ray of its own
def test_a_seeded_tree_does_not_depend_on_batching(tmp_path):
    """A document past a small window, summarized through a tree with seeded sampling: every
    node's tokens, and so the row's, the same one node at a time and four at once."""
    chapter = " ".join(DOCS * 12)  # ~ 600 tokens: a tree of a dozen chunks at this window
    path = tmp_path / "long.parquet"
    pq.write_table(pa.table({"id": ["book"], "document": [chapter]}), path)
    nodes = {}
    for seqs in ("1", "4"):
        out = tmp_path / seqs
        run("job", "--input", str(path), "--output", str(out), *JOB, "--max-model-len", "192",
            "--max-num-seqs", seqs)
        table = pq.read_table(out / "nodes").to_pylist()
        nodes[seqs] = {(n["level"], n["index"]): list(n["generated_tokens"]) for n in table}
        row = pq.read_table(out / "rows").to_pylist()[0]
        assert row["document_path"] == "tree" and row["tree_generations"] == len(table) > 3
        assert list(row["generated_tokens"]) == nodes[seqs][max(nodes[seqs])]
    assert nodes["1"] == nodes["4"]
