"""A book beside short rows on a local Ray with the real engine (the embedded SmolLM2): the
dispatcher's turns between new rows and a tree's nodes (runtime/dispatch.py), counted in
submissions and answers. The same rule on the fakes, quickly: tests/test_tree.py."""

from __future__ import annotations

import pytest

from knapspec_dist.jobs import JobConfig, run_job
from knapspec_dist.runtime.backend import EngineBackend

from fakes import read_rows, write_input

pytestmark = pytest.mark.processes  # a local Ray and its actors


@pytest.mark.e2e
def test_short_rows_beside_a_book_on_the_real_engine(tmp_path):
    """The embedded SmolLM2 on a local Ray, a book of ~10 chunks and four short rows at two
    rows in flight: each short row starts after at most one node per row ahead of it (plus
    the tasks in flight) and ends before the book's last node; counted in submissions and
    answers, not seconds."""
    order: list = []  # ("start" | "end", key): a row's id, a node's (id, level, index)

    class Recording(EngineBackend):
        keys: dict = {}

        def submit(self, replica, prompt_ids, config, key=None):
            order.append(("start", key))
            handle = super().submit(replica, prompt_ids, config, key)
            self.keys[handle] = key
            return handle

        def result(self, handle):
            out = super().result(handle)
            order.append(("end", self.keys[handle]))
            return out

    book = " ".join(f"Chapter {i}. The cat sat on the mat and looked at the garden."
                    for i in range(120))
    shorts = [f"s{i}" for i in range(4)]
    write_input(tmp_path / "in.parquet", ["book", *shorts],
                [book] + ["The dog barked at the moon."] * 4)
    config = JobConfig(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"),
                       strategy="ar", max_new_tokens=4, max_model_len=256, max_num_seqs=2,
                       baseline_fraction=0, progress_bar=False, address="local")
    result = run_job(config, backend_factory=Recording)
    starts = [k for kind, k in order if kind == "start"]
    ends = [k for kind, k in order if kind == "end"]
    nodes = [i for i, k in enumerate(starts) if isinstance(k, tuple)]
    assert len(nodes) > 8
    for k, row in enumerate(shorts):
        start = starts.index(row)
        assert sum(i < start for i in nodes) <= 1 + k + 4, (row, starts[:start + 1])
    last_node = max(i for i, k in enumerate(ends) if isinstance(k, tuple))
    assert all(ends.index(row) < last_node for row in shorts)
    rows = read_rows(result.output)
    assert len(rows) == 5 and all(r["error"] is None for r in rows)
