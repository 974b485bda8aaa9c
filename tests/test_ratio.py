"""A ratio with no data is None everywhere (knapspec_dist/ratio.py): the engine's per-row
and scheduler rates, the output columns and the job summary say null, never a 0.0 that
reads like a measurement."""

from __future__ import annotations

import pyarrow as pa

from knapspec_dist.engine.generation import GenerationResult, GenerationStats
from knapspec_dist.engine.scheduler import Work
from knapspec_dist.jobs.output import output_schema, result_row
from knapspec_dist.jobs.summary import Totals
from knapspec_dist.ratio import ratio, shown


def test_ratio_is_none_without_data():
    assert ratio(3, 2) == 1.5 and ratio(0, 2) == 0.0
    assert ratio(3, 0) is None and ratio(3, None) is None and ratio(None, 2) is None
    assert shown(None, ".1f") == "-" and shown(None, ".1f", "?") == "?"
    assert shown(2.25, ".1f") == "2.2"


def test_a_row_that_drafted_nothing_has_no_acceptance_rate_in_its_output():
    stats = GenerationStats(prompt_tokens=4, new_tokens=3, rounds=2, wall_s=0.5)
    assert stats.acceptance_rate is None and stats.tokens_per_s == 6.0
    row = result_row("id", "a", "ar", GenerationResult([1, 2, 3], stats, "length"))
    table = pa.Table.from_pylist([row], schema=output_schema("id", pa.string()))
    assert table.column("acceptance_rate").to_pylist() == [None]
    assert table.column("tokens_per_s").to_pylist() == [6.0]


def test_a_scheduler_and_a_summary_with_no_rows_say_none():
    w = Work()
    assert (w.tokens_per_s, w.decode_tokens_per_s, w.mean_batch) == (None, None, None)
    t = Totals().throughput()
    assert (t["tokens_per_s"], t["decode_tokens_per_s"], t["mean_batch"]) == (None, None, None)
    assert Totals().acceptance()["acceptance_rate"] is None
