"""Latency profiles as the user meets them: negative costs refused like zero, each point's
spread recorded, a profile measured on a busy machine used but not cached, and the
batch-profile note logged once at INFO."""

from __future__ import annotations

import logging

import pytest

from knapspec_dist.profiles import batching, store
from knapspec_dist.profiles.batching import BatchPricing
from knapspec_dist.profiles.device import cpu_busy
from knapspec_dist.profiles.profile import LatencyProfile, fit_profile
from knapspec_dist.profiles.profiler import _samples, relative_spread

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


@pytest.mark.parametrize("cpus, threads, load, busy", [
    (2, 2, [0.4, 2.1], False),  # its own two threads fill the average after: quiet
    (2, 2, [0.4, 3.1], True),   # one more busy process beside them
    (2, 2, [0.6, 2.0], False),  # its own model load in the minute before: quiet
    (2, 2, [1.9, 2.0], True),   # the minute before was busy
    (2, 1, [0.3, 2.0], False),  # one thread and one other process on two cores
    (16, 1, [0.5, 11.0], False),
    (16, 1, [0.5, 14.0], True),  # above 0.75 x the CPUs, though cores were idle
    (2, 2, [0.4], False),
    (2, 2, [2.0], True),
])
def test_a_busy_cpu_is_the_load_beside_the_measurement_not_its_own(cpus, threads, load, busy):
    info = {"kind": "cpu", "threads": threads, "logical_cpus": cpus, "load_average": load}
    assert (cpu_busy(info) is not None) == busy
    assert cpu_busy({**info, "kind": "cuda"}) is None
    assert cpu_busy({k: v for k, v in info.items() if k != "load_average"}) is None


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
    assert any("load beside the measurement was 5.5 on 2 CPUs" in r.getMessage()
               for r in caplog.records)

    steady = profile(spread=0.05, load=[0.2, 0.3])
    kept = store.resolve(None, [device], SHAPE, "float32",
                         measure=lambda contexts, mode: steady, need=256)
    assert kept.path and (tmp_path / "cache" / f"{steady.key()}.json").is_file()
    again = store.resolve(None, [device], SHAPE, "float32",
                          measure=lambda contexts, mode: pytest.fail("measured again"), need=256)
    assert again.origin == "loaded" and again.profile == steady


def test_the_profiler_records_each_points_relative_spread():
    assert relative_spread([1.0, 2.0, 3.0]) == pytest.approx(1.0)
    raw = {"attention": {8: [1.0, 1.1, 1.0]}, "mlp": {8: [2.0, 2.0, 2.0]},
           "head": {8: [1.0, 3.0, 1.0]}, "total": {8: [5.0, 5.0, 5.0]},
           "verify": {(1, 8): [4.0, 4.0, 8.0]}}
    samples = _samples(raw, [8], [1], tp=1, group=None)
    assert samples["spread"] == {"attention": [[8, pytest.approx(0.1)]], "mlp": [[8, 0.0]],
                                 "head": [[8, 2.0]], "verify": [[1, 8, 1.0]]}
    assert samples["head"] == [1.0] and samples["verify"] == [[1, 8, 4.0]]


def test_the_batch_profile_note_is_one_warning_per_process(caplog, monkeypatch):
    monkeypatch.setattr(batching, "_NOTED", set(), raising=False)  # (main: no such set)
    with caplog.at_level(logging.DEBUG, logger="knapspec_dist.profiles.batching"):
        for _ in range(3):  # every shard (and every job) builds its own pricing
            pricing = BatchPricing([profile(batch=1)])
            for _ in range(5):  # every round, at every batch size continuous batching passes
                assert pricing.at(2).batch == 1
                assert pricing.at(3).batch == 1
                pricing._cache.clear()
    notes = [r for r in caplog.records if "no latency profile" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING  # a guess, never silent
    assert "no latency profile at batch 2" in notes[0].getMessage()
    assert "(measured: [1]): pricing it as batch 1, the nearest" in notes[0].getMessage()
