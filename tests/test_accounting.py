"""A row's time split (engine/generation.py ``Split``): each shard call's split shared among
the rows in it, the rows adding up to the calls, and one engine call's summary of them
(runtime/accounting.py)."""

from __future__ import annotations

from dataclasses import astuple

import pytest

from knapspec_dist.engine.generation import GenerationResult, GenerationStats, Split
from knapspec_dist.runtime.accounting import job_summary, split


def test_a_shard_calls_split_partitions_its_wall_time():
    parts = split(wall_s=10.0, metered_s=6.0, comm_s=2.0, comm_calls=8)
    assert astuple(parts) == (4.0, 2.0, 0.0, 4.0, 8)  # compute is metered less comm


def test_rows_share_each_call_and_add_up_to_the_calls():
    """Call 1 (three rows in it) and call 2 (two of them): every row holds its share of
    each, and the rows together hold both calls whole."""
    first = split(wall_s=6.0, metered_s=3.0, comm_s=1.5, comm_calls=6)
    second = split(wall_s=4.0, metered_s=2.0, comm_s=1.0, comm_calls=4)
    rows = {rid: Split() for rid in "abc"}
    for share in rows.values():
        share.add(first, len(rows))
    for rid in "ab":
        rows[rid].add(second, 2)
    assert rows["c"].comm_calls == pytest.approx(2.0)
    assert rows["a"].compute_s == pytest.approx(1.5 / 3 + 1.0 / 2)
    rows["a"].ray_s += 0.25  # the coordinator's round trips for row a
    results = [GenerationResult([1], GenerationStats(new_tokens=1, split=s), "length",
                                replica=0) for s in rows.values()]
    summary = job_summary(results, wall_s=11.0, replicas=1)
    assert summary["compute_s"] == pytest.approx(first.compute_s + second.compute_s)
    assert summary["other_s"] == pytest.approx(first.other_s + second.other_s)
    assert summary["ray_s"] == pytest.approx(0.25) and summary["comm_calls"] == 10
    assert summary["idle_s"] == pytest.approx(11.0 - 10.25)
