"""What a finished job shows: the report and summary when the strategy drafted nothing, and
``speedup.png``'s data (every main-pass row, the baseline pair, a big job thinned)."""

from __future__ import annotations

import datetime as dt
import tracemalloc

import pyarrow as pa

from knapspec_dist.jobs import plot
from knapspec_dist.jobs.output import output_schema
from knapspec_dist.jobs.plot import plot_data, write_plot
from knapspec_dist.jobs.report import report
from knapspec_dist.jobs.runner import JobResult
from knapspec_dist.jobs.summary import summarize

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def row(i: int, n: int, tps: float, drafted: int = 0, strategy: str = "knapspec",
        start: float = 0.0, copied: int = 0, copied_accepted: int = 0) -> dict:
    tokens = 8
    wall = tokens / tps
    return {"id": f"r{i}", "generated_text": "x", "generated_tokens": [1] * tokens,
            "num_input_tokens": n, "num_generated_tokens": tokens, "finish_reason": "length",
            "strategy": strategy, "time_taken_llm": wall, "prefill_s": 0.01,
            "tokens_per_s": tps, "rounds": tokens, "drafted": drafted,
            "accepted": drafted // 2, "acceptance_rate": 0.5 if drafted else None,
            "copied_drafted": copied, "copied_accepted": copied_accepted,
            "attention_skipped": None, "mlp_skipped": None, "selections": 0,
            "truncated": False, "replica": 0, "attempts": 1, "finished_at": T0,
            "generation_start": T0 + dt.timedelta(seconds=start),
            "generation_end": T0 + dt.timedelta(seconds=start + wall), "mean_batch": 1.0,
            "error": None}


def table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=output_schema("id", pa.string()))


def job_summary(drafted: int):
    main = [row(i, 100 * (i + 1), 20.0 + i, drafted) for i in range(5)]
    again = [row(2, 300, 21.0, drafted)]
    base = [row(2, 300, 20.0, 0, "ar")]
    summary = summarize(table(main), table(base), "id", [r["id"] for r in main],
                        {"strategy": "knapspec", "model": "smollm2"}, {"max_num_seqs": 1},
                        again=table(again))
    return summary, table(main), table(base), table(again)


def result_of(summary: dict) -> JobResult:
    return JobResult(output="o", rows_path="o/rows", summary_path="o/summary.json",
                     plot_path="o/speedup.png", summary=summary, generated=5)


def test_a_strategy_that_drafted_nothing_says_so_and_labels_the_speedup_noise():
    summary, *_ = job_summary(drafted=0)
    assert summary["acceptance"]["note"] == ("knapspec chose plain decoding for every row: "
                                             "no draft, copied or from a subnet, paid on "
                                             "this hardware")
    assert summary["baseline"]["note"] == ("both passes decoded plainly: this is run-to-run "
                                           "noise, not a speedup")
    text = report(result_of(summary))
    assert ("knapspec chose plain decoding for every row: no draft, copied or from a subnet, "
            "paid on this hardware") in text
    assert ("speedup vs ar: 1.05x (both passes decoded plainly: this is run-to-run noise, "
            "not a speedup)") in text

    drafting, *_ = job_summary(drafted=6)  # a strategy that drafted: no note, plain speedup
    assert "note" not in drafting["acceptance"] and "note" not in drafting["baseline"]
    text = report(result_of(drafting))
    assert "plain decoding" not in text and "noise" not in text
    assert "speedup vs ar: 1.05x, measured on 1 baseline row(s)" in text


def test_speedup_png_shows_every_main_pass_row_and_marks_the_baseline_pair():
    summary, main, base, again = job_summary(drafted=0)
    data = plot_data(summary, main, base, "id", again=again)
    assert data["rows"] == [(100 * (i + 1), 20.0 + i) for i in range(5)]  # one point per row
    assert data["pairs"] == [(300, 21.0, 20.0)]  # the baseline pair: strategy, ar
    assert "run-to-run noise" in data["title"]
    written = []
    assert write_plot(summary, main, base, "id", written.append, again=again) == data
    assert written and written[0][:8] == b"\x89PNG\r\n\x1a\n"


def test_speedup_png_of_many_rows_draws_every_kth_and_builds_no_row_objects(monkeypatch):
    """A big job's plot thins its scatter to MAX_POINTS, evenly over the rows, and never turns
    the main pass into one Python object per row (Arrow filters it)."""
    summary, _, base, again = job_summary(drafted=4)
    n = 100_000  # the old per-row objects: ~31 MiB of Python heap here, ~300 bytes a row
    rows = pa.table({"num_input_tokens": pa.array(range(1, n + 1), pa.int64()),
                     "tokens_per_s": pa.array([float(i % 7) for i in range(n)]),
                     "acceptance_rate": pa.array([0.5] * n),
                     "drafted": pa.array([2 * (i % 2) for i in range(n)], pa.int64()),
                     "accepted": pa.array([i % 2 for i in range(n)], pa.int64()),
                     "error": pa.array([None if i % 10 else "boom" for i in range(n)],
                                       pa.string())})
    monkeypatch.setattr(plot, "MAX_POINTS", 1000, raising=False)
    tracemalloc.start()
    data = plot.plot_data(summary, rows, base.slice(0, 0), "id")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB of Python objects for the plot's data"
    ok = [(i + 1, float(i % 7)) for i in range(n) if i % 10 and i % 7]
    assert len(data["rows"]) <= 1000 and data["rows"][0] == ok[0]
    step = -(-len(ok) // 1000)
    assert data["rows"] == ok[::step]
    drafting = [(i + 1, 0.5) for i in range(n) if i % 10 and i % 2]
    assert data["acceptance"] == {"copied": [],  # a table without the copied columns
                                  "subnet": drafting[::-(-len(drafting) // 1000)]}


def test_the_acceptance_panel_shows_each_source_of_drafts_apart():
    """Per row, copied drafts' acceptance over its copied drafts, a subnet's over the rest;
    a row that drafted from one source only is a point of that source alone."""
    main = [row(0, 100, 20.0, drafted=10, copied=10, copied_accepted=5),  # copies only
            row(1, 200, 20.0, drafted=10, copied=4, copied_accepted=4),  # both: 4/4, 1/6
            row(2, 300, 20.0, drafted=0)]  # plain throughout: no point
    main[1]["accepted"] = 5
    summary = summarize(table(main), table([]), "id", [r["id"] for r in main],
                        {"strategy": "knapspec", "model": "smollm2"}, {"max_num_seqs": 1})
    data = plot_data(summary, table(main), table([]), "id")
    assert data["acceptance"] == {"copied": [(100, 0.5), (200, 1.0)],
                                  "subnet": [(200, 1 / 6)]}
    assert summary["acceptance"]["by_source"]["copied"]["drafted"] == 14
    written = []
    write_plot(summary, table(main), table([]), "id", written.append)
    assert written[0][:8] == b"\x89PNG\r\n\x1a\n"
