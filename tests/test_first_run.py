"""The first run on a machine that no stored profile names (every shipped profile is another
CPU's): it starts at once from another device's profile of the same model, which online
calibration refits, instead of measuring inside the start-up timeout; where it must measure
(calibration off), the measurement does not count against that timeout.

The foreign profile is a real measurement of the test model on this machine, relabelled
as another CPU's: what the lookup sees on an AMD machine beside the shipped Intel profiles.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from knapspec_dist.model.weights import load_model
from knapspec_dist.profiles import store
from knapspec_dist.profiles.device import device_info
from knapspec_dist.profiles.profile import LatencyProfile
from knapspec_dist.profiles.profiler import measure
from knapspec_dist.runtime import RayEngine, replica
from knapspec_dist.runtime.coordinator import calibrates
from knapspec_dist.speculation.factory import build_selector
from knapspec_dist.speculation.options import StrategyOptions, parse_strategy

from conftest import random_prompt
from faults import slow_measure
from models import make_checkpoint

pytestmark = pytest.mark.processes  # a local Ray

ray = pytest.importorskip("ray")

OTHER_CPU = {"kind": "cpu", "name": "AMD EPYC 7B13 64-Core Processor (1 threads)",
             "cpu_model": "AMD EPYC 7B13 64-Core Processor", "threads": 1, "logical_cpus": 2,
             "machine": "x86_64"}
STARTUP_S = 30.0  # the engines' start-up timeout per phase here (an actor start on a loaded
# 2-core machine can take 20 s); the slow measurement takes longer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("llama-gqa", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


def foreign(profile: LatencyProfile, batch: int | None = None) -> LatencyProfile:
    """``profile`` as if measured on another CPU (the name and model differ from this one's)."""
    data = profile.to_json()
    data["device"] = dict(OTHER_CPU)
    if batch is not None:
        data["batch"] = batch
    return LatencyProfile.from_json(data)


@pytest.fixture(scope="module")
def other_cpus_profile(model) -> LatencyProfile:
    return foreign(measure(model, contexts=[16, 64], repeats=1, max_q=4))


@pytest.fixture
def dirs(tmp_path, monkeypatch, other_cpus_profile):
    """A profiles folder holding only another CPU's profiles (batch 1 and 2) and an empty
    cache."""
    shipped, cache = tmp_path / "profiles", tmp_path / "cache"
    monkeypatch.setenv("KNAPSPEC_PROFILES", str(shipped))
    monkeypatch.setenv("KNAPSPEC_PROFILE_CACHE", str(cache))
    monkeypatch.setenv("KNAPSPEC_PROFILE_MAX_SPREAD", "inf")
    for p in (other_cpus_profile, foreign(other_cpus_profile, batch=2)):
        p.save(shipped / f"{p.key()}.json")
    return shipped, cache


def test_no_match_borrows_another_cpus_profile_relabelled(model, dirs, other_cpus_profile):
    shipped, cache = dirs
    here = device_info(model.device)
    assert here["name"] != OTHER_CPU["name"]
    shape = model.cfg.shape()
    assert store.lookup(None, [here], shape, "fp32") is None  # without borrow: measure
    choice = store.lookup(None, [here], shape, "fp32", need=200, borrow=True)
    assert choice is not None and choice.origin == "borrowed"
    assert choice.path == str(shipped / f"{other_cpus_profile.key()}.json")
    p = choice.profile
    assert p.device == here and p.origin == "borrowed"  # its refits are this machine's
    assert p.samples["borrowed"]["device"]["name"] == OTHER_CPU["name"]
    assert p.verify == other_cpus_profile.verify and p.mlp == other_cpus_profile.mlp
    assert [s.batch for s in choice.siblings] == [2]
    assert all(s.device == here and s.origin == "borrowed" for s in choice.siblings)
    assert LatencyProfile.from_json(json.loads(json.dumps(p.to_json()))) == p  # to the shards
    assert not cache.exists()  # nothing measured, nothing kept

    # another model shape, or another kind of device: nothing to start from
    assert store.lookup(None, [here], {**shape, "layers": 7}, "fp32", borrow=True) is None
    gpu = {"kind": "cuda", "name": "NVIDIA H200"}
    assert store.starting_point(gpu, shape, "fp32", mode="eager") is None


def test_this_machines_online_refit_comes_before_another_cpus(model, dirs):
    here = device_info(model.device)
    shape = model.cfg.shape()
    first = store.lookup(None, [here], shape, "fp32", borrow=True)
    refit = LatencyProfile.from_json({**first.profile.to_json(), "origin": "online",
                                      "mlp": 2 * first.profile.mlp})
    path = store.keep_online(refit)
    assert path == str(store.online_profiles_dir() / f"{refit.key()}.json")
    again = store.lookup(None, [here], shape, "fp32", borrow=True)
    assert again.origin == "borrowed" and again.path == path
    assert again.profile.mlp == refit.mlp and again.profile.device == here
    # the source of the prices is still the other CPU's file
    assert again.profile.samples["borrowed"]["device"]["name"] == OTHER_CPU["name"]


def test_a_paged_run_borrows_relabelled_over_pages_and_finds_its_paged_refit(model, dirs):
    """The shipped profiles are over fixed slots; a run over pages starts from one relabelled
    over pages, so its refit is kept over pages, and found by the next paged run only."""
    here, shape = device_info(model.device), model.cfg.shape()
    first = store.lookup(None, [here], shape, "fp32", borrow=True, kv="paged")
    assert first.origin == "borrowed" and first.profile.kv == "paged"
    assert all(s.kv == "paged" for s in first.siblings)
    refit = LatencyProfile.from_json({**first.profile.to_json(), "origin": "online",
                                      "mlp": 2 * first.profile.mlp})
    path = store.keep_online(refit)
    assert path.endswith("__paged.json")
    again = store.lookup(None, [here], shape, "fp32", borrow=True, kv="paged")
    assert again.path == path and again.profile.mlp == refit.mlp
    fixed = store.lookup(None, [here], shape, "fp32", borrow=True)  # over fixed slots
    assert fixed.path != path and fixed.profile.kv == "fixed"


def test_this_devices_profile_over_the_other_layout_is_relabelled_for_the_run(
        model, dirs, other_cpus_profile):
    shipped, _ = dirs
    here, shape = device_info(model.device), model.cfg.shape()
    mine = replace(other_cpus_profile, device=here)  # as if measured here, over fixed slots
    mine.save(shipped / f"{mine.key()}.json")
    choice = store.lookup(None, [here], shape, "fp32", borrow=True, kv="paged")
    assert choice.origin == "borrowed" and choice.path == str(shipped / f"{mine.key()}.json")
    assert choice.profile.kv == "paged" and choice.profile.mlp == mine.mlp
    assert choice.profile.samples["borrowed"]["why"] == "measured over fixed KV"


@pytest.mark.parametrize("name", ["knapspec", "knapspec:paper", "knapspec:fixed",
                                  "knapspec:calibrate", "clasp"])
def test_only_strategies_that_refit_their_prices_borrow(model, other_cpus_profile, name):
    options = parse_strategy(name).options
    selector = build_selector(options, model, [other_cpus_profile])
    assert calibrates(options) == selector.config.calibrate


@pytest.fixture
def cluster():
    os.environ["OMP_NUM_THREADS"] = "1"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.e2e
def test_engine_starts_from_another_cpus_profile_and_a_measurement_is_not_timed_out(
        dirs, cluster, checkpoint, model, monkeypatch):
    """The start must not measure (the shards' measurement outlasts the start-up timeout:
    today's engines failed here with "did not prepare within 20s"); it prepares at once
    and generates ar's tokens. ``knapspec:fixed`` (no calibration) must measure: that takes
    longer than the timeout and still prepares, since it is not counted, and measures over the
    paged cache the replica decodes over."""
    shipped, cache = dirs
    prompts = [random_prompt(n, model.cfg.vocab_size, seed=50 + n) for n in (7, 12)]
    greedy = dict(max_new_tokens=10, stop_at_eos=False)
    knapspec = StrategyOptions(name="knapspec", interval=4, tau_conf=0.0)
    monkeypatch.setattr(replica, "Shard", slow_measure(STARTUP_S + 5))
    with RayEngine(str(checkpoint), strategy=knapspec, startup_timeout_s=STARTUP_S,
                profile_need=200,
                profile_contexts=[16, 32], profile_repeats=1) as engine:
        info = engine.replica_info(0)
        assert info.profile["origin"] == "borrowed", info
        assert info.profile["path"].startswith(str(shipped)), info
        assert not list(cache.glob("*.json"))  # nothing was measured
        results = engine.generate(prompts, **greedy)
        engine.reconfigure("ar")
        expected = [r.token_ids for r in engine.generate(prompts, **greedy)]
        assert [r.token_ids for r in results] == expected

        engine.reconfigure(StrategyOptions(name="knapspec", calibrate=False, interval=4,
                                           tau_conf=0.0))
        info = engine.replica_info(0)
        assert info.profile["origin"] == "measured", info
        assert info.profile["key"].endswith("__paged"), info  # over the pages it decodes over
        assert [r.token_ids for r in engine.generate(prompts, **greedy)] == expected


@pytest.mark.parametrize("field,other", [("isa", ["avx2", "avx512f", "fma", "sve"]),
                                         ("kernels", "an-other-build")])
def test_a_cpu_of_the_same_name_with_another_vector_unit_borrows(model, dirs,
                                                                   other_cpus_profile, field,
                                                                   other):
    """One CPU model name covers AVX2-only and AVX-512 parts: a profile of the same name
    measured on another vector unit, or over another build of our kernels, is another CPU's
    (a starting point that calibration checks). A profile over another build is kept under
    another key (the build follows the vector unit unless the setting forces one)."""
    shipped, _ = dirs
    here, shape = device_info(model.device), model.cfg.shape()
    assert here["kernels"] and "isa" in here
    twin = replace(other_cpus_profile, device={**here, field: other})
    twin.save(shipped / f"{twin.key()}.json")
    assert store.lookup(None, [here], shape, "fp32") is None
    choice = store.lookup(None, [here], shape, "fp32", borrow=True)
    assert choice.origin == "borrowed" and choice.profile.device == here
    mine = replace(other_cpus_profile, device=here)
    mine.save(shipped / f"{mine.key()}.json")
    assert (mine.key() != twin.key()) == (field == "kernels")
    found = store.lookup(None, [here], shape, "fp32")
    assert found is not None and found.origin == "loaded" and found.profile.device == here
