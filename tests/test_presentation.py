"""What a user is shown, unit by unit: negative profile costs refused, a busy-machine profile not
cached, the batch-profile note logged once at INFO, and what the demo shows when the
strategy drafted nothing (report, summary.json, speedup.png's data)."""

from __future__ import annotations

import datetime as dt
import logging
import tracemalloc

import pyarrow as pa
import pytest

from knapspec_dist.jobs import plot
from knapspec_dist.jobs.output import output_schema
from knapspec_dist.jobs.plot import plot_data, write_plot
from knapspec_dist.jobs.report import report
from knapspec_dist.jobs.runner import JobResult
from knapspec_dist.jobs.summary import summarize
from knapspec_dist.profiles import batching, store
from knapspec_dist.profiles.batching import BatchPricing
from knapspec_dist.profiles.profile import LatencyProfile, fit_profile
from knapspec_dist.runtime import cluster

SHAPE = {"layers": 2, "hidden": 8, "heads": 2, "kv_heads": 1, "head_dim": 4,
         "intermediate": 16, "vocab": 32}


def profile(batch: int = 1, spread: float | None = None, load: list | None = None,
            **samples) -> LatencyProfile:
    raw = {"attention": [[64, 2e-4], [256, 3e-4]], "mlp": [1e-4, 1e-4], "head": [5e-4, 5e-4],
           "verify": [[1, 64, 2e-3], [1, 256, 3e-3], [2, 64, 3e-3], [2, 256, 4e-3]], **samples}
    if spread is not None:  # what the profiler records: each point's (max - min) / median
        raw["spread"] = {"attention": [[64, spread], [256, spread]],
                         "mlp": [[64, spread], [256, spread]],
                         "head": [[64, spread], [256, spread]],
                         "verify": [[q, n, spread] for q in (1, 2) for n in (64, 256)]}
    device = {"name": "cpu-x", "kind": "cpu", "threads": 2, "logical_cpus": 2}
    if load is not None:
        device["load_average"] = load
    return fit_profile(raw, device=device,
                       model=dict(SHAPE), dtype="float32", batch=batch, tp=1,
                       torch_version="2", created="2025-01-01")


# ----------------------------------------------------------------------------- profiles

@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(head=-1e-4), "'head' is a cost and must be >= 0"),
    (lambda d: d.update(head=0.0), None),  # a zero head (all outside the sublayers) is fine
    (lambda d: d.update(mlp=-1e-4), "'mlp' must be > 0"),
    (lambda d: d.update(allreduce=-1e-6), "'allreduce' is a cost"),
    (lambda d: d["attention"].update(intercept=-0.1), "'attention' gives a time <= 0"),
    (lambda d: d["verify"]["2"].update(intercept=-0.1), "'verify.2' gives a negative time"),
    (lambda d: d["samples"]["head"].__setitem__(0, -5e-4), "'samples.head' is a cost"),
    (lambda d: d["samples"]["attention"][0].__setitem__(1, -2e-4),
     "'samples.attention seconds' is a cost"),
    (lambda d: d["samples"]["verify"][0].__setitem__(2, -1.0), "'samples.verify seconds' is a"),
])
def test_a_negative_cost_is_refused_like_zero(tmp_path, edit, message):
    data = profile().to_json()
    edit(data)
    if message is None:
        assert LatencyProfile.from_json(data).head == 0.0
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        LatencyProfile.from_json(data)
    path = tmp_path / "p.json"
    path.write_text(__import__("json").dumps(data))
    with pytest.raises(store.UserError, match="is malformed"):  # --profile: one error line
        store.load_profile(path)


def test_the_spread_is_recorded_and_round_trips():
    p = profile(spread=0.1)
    assert p.spread() == pytest.approx(0.1)
    assert LatencyProfile.from_json(p.to_json()) == p
    assert profile().spread() is None  # a hand-made profile records none: steady


def test_a_profile_measured_on_a_busy_machine_is_used_not_cached(tmp_path, monkeypatch,
                                                                 caplog):
    monkeypatch.setenv("KNAPSPEC_PROFILES", str(tmp_path / "repo"))
    monkeypatch.setenv("KNAPSPEC_PROFILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KNAPSPEC_PROFILE_MAX_SPREAD", raising=False)
    device = {"name": "cpu-x", "kind": "cpu", "threads": 2, "logical_cpus": 2}
    busy = profile(spread=1.5)  # repeats differed by 1.5x their median
    with caplog.at_level(logging.WARNING, logger="knapspec_dist.profiles.store"):
        choice = store.resolve(None, [device], SHAPE, "float32",
                               measure=lambda contexts, mode: busy, need=256)
    assert choice.profile is busy and choice.origin == "measured" and choice.path is None
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())
    warned = [r for r in caplog.records if "not kept" in r.getMessage()]
    assert len(warned) == 1 and "busy" in warned[0].getMessage()
    assert "1.50" in warned[0].getMessage() and "0.25" in warned[0].getMessage()

    loaded_cpu = profile(spread=0.05, load=[5.5, 5.9])  # steady repeats, but a busy CPU
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="knapspec_dist.profiles.store"):
        choice = store.resolve(None, [device], SHAPE, "float32",
                               measure=lambda contexts, mode: loaded_cpu, need=256)
    assert choice.path is None and not (tmp_path / "cache").exists()
    assert any("load average was 5.9 on 2 CPUs" in r.getMessage() for r in caplog.records)

    steady = profile(spread=0.05, load=[0.2, 0.3])
    kept = store.resolve(None, [device], SHAPE, "float32",
                         measure=lambda contexts, mode: steady, need=256)
    assert kept.path and (tmp_path / "cache" / f"{steady.key()}.json").is_file()
    again = store.resolve(None, [device], SHAPE, "float32",
                          measure=lambda contexts, mode: pytest.fail("measured again"), need=256)
    assert again.origin == "loaded" and again.profile == steady


def test_the_profiler_records_each_points_relative_spread():
    from knapspec_dist.profiles.profiler import _samples, relative_spread

    assert relative_spread([1.0, 2.0, 3.0]) == pytest.approx(1.0)
    raw = {"attention": {8: [1.0, 1.1, 1.0]}, "mlp": {8: [2.0, 2.0, 2.0]},
           "head": {8: [1.0, 3.0, 1.0]}, "total": {8: [5.0, 5.0, 5.0]},
           "verify": {(1, 8): [4.0, 4.0, 8.0]}}
    samples = _samples(raw, [8], [1], tp=1, group=None)
    assert samples["spread"] == {"attention": [[8, pytest.approx(0.1)]], "mlp": [[8, 0.0]],
                                 "head": [[8, 2.0]], "verify": [[1, 8, 1.0]]}
    assert samples["head"] == [1.0] and samples["verify"] == [[1, 8, 4.0]]


def test_the_batch_profile_note_is_logged_once_per_process_at_info(caplog, monkeypatch):
    monkeypatch.setattr(batching, "_NOTED", set(), raising=False)  # (main: no such set)
    with caplog.at_level(logging.DEBUG, logger="knapspec_dist.profiles.batching"):
        for _ in range(3):  # every shard (and every job) builds its own pricing
            pricing = BatchPricing([profile(batch=1)])
            for _ in range(5):  # every round, at every batch size continuous batching passes
                assert pricing.at(2).batch == 1
                assert pricing.at(3).batch == 1
                pricing._cache.clear()
    notes = [r for r in caplog.records if "no latency profile" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO
    assert "no latency profile at batch 2" in notes[0].getMessage()
    assert "(measured: [1]); pricing it as batch 1" in notes[0].getMessage()


# ----------------------------------------------------------------------------- the demo's report

T0 = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)


def row(i: int, n: int, tps: float, drafted: int = 0, strategy: str = "knapspec",
        start: float = 0.0) -> dict:
    tokens = 8
    wall = tokens / tps
    return {"id": f"r{i}", "generated_text": "x", "generated_tokens": [1] * tokens,
            "num_input_tokens": n, "num_generated_tokens": tokens, "finish_reason": "length",
            "strategy": strategy, "time_taken_llm": wall, "prefill_s": 0.01,
            "tokens_per_s": tps, "steps": tokens, "drafted": drafted,
            "accepted": drafted // 2, "acceptance_rate": 0.5 if drafted else None,
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
                                             "no subnet paid on this hardware")
    assert summary["baseline"]["note"] == ("both passes decoded plainly: this is run-to-run "
                                           "noise, not a speedup")
    text = report(result_of(summary))
    assert "knapspec chose plain decoding for every row: no subnet paid on this hardware" in text
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


@pytest.mark.parametrize("message, level", [
    ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled ...",
     logging.INFO),
    ("Token authentication is disabled for this Ray cluster. Anyone with network ...",
     logging.WARNING),
])
def test_rays_token_auth_default_is_info_and_its_disabled_warning_stays(message, level):
    """The demo printed Ray's "Token authentication is enabled" as its one WARNING line."""
    record = logging.LogRecord(cluster.RAY_AUTH_LOG, logging.WARNING, __file__, 1, message,
                               None, None)
    cluster._AUTH_FILTER.filter(record)
    assert record.levelno == level and record.levelname == logging.getLevelName(level)


def test_speedup_png_of_many_rows_draws_every_kth_and_builds_no_row_objects(monkeypatch):
    """A big job's plot thins its scatter to MAX_POINTS, evenly over the rows, and never turns
    the main pass into one Python object per row (Arrow filters it)."""
    summary, _, base, again = job_summary(drafted=4)
    n = 100_000  # the old per-row objects: ~31 MiB of Python heap here, ~300 bytes a row
    rows = pa.table({"num_input_tokens": pa.array(range(1, n + 1), pa.int64()),
                     "tokens_per_s": pa.array([float(i % 7) for i in range(n)]),
                     "acceptance_rate": pa.array([0.5] * n),
                     "drafted": pa.array([i % 2 for i in range(n)], pa.int64()),
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
    assert data["acceptance"] == drafting[::-(-len(drafting) // 1000)]
