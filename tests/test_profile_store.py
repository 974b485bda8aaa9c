"""Profile persistence and the execution mode: a profile is measured once
per hardware, kept in the profile cache, found by later runs (and other replicas), must cover
the run's longest context, and is keyed by its execution mode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from knapspec_dist.engine.memory import kv_bytes_per_token
from knapspec_dist.errors import UserError
from knapspec_dist.model.paged_cache import SCRATCH, PagedKVCache
from knapspec_dist.model.weights import load_model
from knapspec_dist.profiles import LatencyProfile, profiler, store
from knapspec_dist.profiles.profiler import measure, profile_cache
from knapspec_dist.runtime.messages import ReplicaInfo
from knapspec_dist.speculation.factory import build_selector
from knapspec_dist.speculation.options import StrategyOptions

from fakes import FakeEngines, docs_of, job, run, write_input
from models import make_checkpoint

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_checkpoint("llama-gqa", tmp_path_factory.mktemp("ckpt")))


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("KNAPSPEC_PROFILES", str(tmp_path / "repo-profiles"))
    monkeypatch.setenv("KNAPSPEC_PROFILE_CACHE", str(tmp_path / "cache"))
    # Timings of a tiny model on a shared CI machine disagree between repeats; these tests
    # are about where profiles are kept, not about the busy-machine rule (test_profile_checks).
    monkeypatch.setenv("KNAPSPEC_PROFILE_MAX_SPREAD", "inf")
    return tmp_path / "repo-profiles", tmp_path / "cache"


def test_measured_once_kept_in_the_cache_and_loaded_by_the_next_run(model, dirs, monkeypatch):
    _, cache = dirs
    first = store.resolve_for_model(None, model, need=100)
    assert first.origin == "measured" and first.profile.mode == "eager"
    assert first.profile.max_context == 100  # covers the run: contexts up to what it needs
    assert sorted({int(n) for n, _ in first.profile.samples["attention"]}) == [64, 100]
    assert first.path == str(cache / f"{first.profile.key()}.json")
    assert Path(first.path).is_file()

    monkeypatch.setattr(profiler, "measure", lambda *a, **k: pytest.fail("measured again"))
    again = store.resolve_for_model(None, model, need=80)  # a shorter run: the kept one covers it
    assert again.origin == "loaded" and again.path == first.path
    assert again.profile == first.profile
    assert again.describe() == {"key": first.profile.key(), "path": first.path,
                                "origin": "loaded"}


def test_a_kept_profile_too_short_for_the_run_is_measured_again(model, dirs):
    first = store.resolve_for_model(None, model, need=40)
    longer = store.resolve_for_model(None, model, need=150)
    assert longer.origin == "measured" and longer.profile.max_context == 150
    assert longer.path == first.path  # same key: the longer one replaces it
    assert store.resolve_for_model(None, model, need=120).origin == "loaded"


def test_the_repository_profiles_come_before_the_cache(model, dirs):
    repo, cache = dirs
    kept = store.resolve_for_model(None, model, need=64)
    repo.mkdir()
    shutil.copy(kept.path, repo / "mine.json")
    assert store.resolve_for_model(None, model, need=64).path == str(repo / "mine.json")


def test_the_mode_is_recorded_keyed_and_matched(model, dirs):
    profile = store.resolve_for_model(None, model, need=32).profile
    data = profile.to_json()
    assert data["mode"] == "eager" and profile.key().endswith("__eager")
    del data["mode"]  # every profile measured before the field existed was eager
    assert LatencyProfile.from_json(data).mode == "eager"
    graph = LatencyProfile.from_json({**data, "mode": "graph"})
    assert graph.key().endswith("__graph") and graph.key() != profile.key()
    device = profile.device
    shape, dtype = profile.model, profile.dtype
    assert store.matches(profile, device, shape, dtype, 1, 1, "eager")
    assert not store.matches(graph, device, shape, dtype, 1, 1, "eager")
    with pytest.raises(ValueError, match="'mode' must be one of"):
        LatencyProfile.from_json({**data, "mode": "fast"})
    replayed = measure(model, [8], max_q=1, repeats=1, mode="graph")  # the runner's stand-in
    assert replayed.mode == "graph" and replayed.key().endswith("__graph")  # on a CPU
    assert store.decode_mode({"kind": "cuda"}) == "graph"
    assert store.decode_mode(profile.device) == "eager"
    with pytest.raises(ValueError):
        measure(model, [8], max_q=1, repeats=1, mode="turbo")


def test_the_committed_profile_is_named_by_its_key_and_loads_as_eager():
    files = sorted((REPO / "profiles").glob("*.json"))
    assert files
    for path in files:
        profile = store.load_profile(path)
        data = json.loads(path.read_text())  # those measured before the field have no mode
        assert profile.mode == data.get("mode", "eager") == "eager"  # CPU profiles
        assert path.name == f"{profile.key()}.json"


def test_load_profile_refuses_another_shape_with_one_message(model, tmp_path):
    path = next((REPO / "profiles").glob("*.json"))
    with pytest.raises(UserError, match=r"another model shape \(.*layers: 30 \(profile\) vs "):
        store.load_profile(path, model.cfg.shape())
    with pytest.raises(UserError, match="cannot load latency profile"):
        store.load_profile(tmp_path / "missing.json")


def test_the_job_summary_says_which_profile_priced_the_run(tmp_path):
    class Engines(FakeEngines):
        def replica_info(self, replica):
            return ReplicaInfo(replica, profile={"key": "k", "path": "/p/k.json",
                                                 "origin": "measured"})

    write_input(tmp_path / "in.parquet", ["a", "b"], docs_of([3, 4]))
    result, _ = run(job(tmp_path), Engines())
    summary = json.loads(Path(result.summary_path).read_text())
    assert summary["run"]["profile"] == {"key": "k", "path": "/p/k.json", "origin": "measured"}


def test_profiles_at_other_batch_sizes_price_batched_rounds(model, dirs, tmp_path):
    """A stored batch-8 profile beside the batch-1 one: knapspec's selector gets both and
    prices a round of 4 rows between them."""
    repo, _ = dirs
    one = store.resolve_for_model(None, model, need=64).profile
    eight = measure(model, [64], batch=8, max_q=3, repeats=1)
    repo.mkdir(parents=True, exist_ok=True)
    eight.save(repo / f"{eight.key()}.json")
    assert [p.batch for p in store.batch_siblings(one)] == [8]
    selector = build_selector(StrategyOptions(name="knapspec"), model)
    assert selector.pricing.batches == [1, 8]
    mid = selector.pricing.at(4)
    assert mid.mlp == pytest.approx(one.mlp + (eight.mlp - one.mlp) * 3 / 7)
    named = tmp_path / "named.json"
    one.save(named)
    given = build_selector(StrategyOptions(name="knapspec", profile=str(named)), model)
    assert given.pricing.batches == [1]  # a profile the user named is used alone
    passed = build_selector(StrategyOptions(name="knapspec"), model, [one])
    assert passed.pricing.batches == [1]  # as are the profiles a caller passes


def test_one_resolver_measures_through_its_callback_for_any_ranks(model, dirs):
    """The Ray path's resolve: ranks on different devices never match a stored profile and
    are measured through the callback, at the default contexts (capped at the window) when
    the run's longest context is unknown; the kept profile is then found for one device."""
    kept = store.resolve_for_model(None, model, need=64)
    device, shape, dtype = kept.profile.device, kept.profile.model, kept.profile.dtype
    asked = []

    def measure(contexts, mode):
        asked.append((contexts, mode))
        return kept.profile

    other = {**device, "name": "another"}
    mixed = store.resolve(None, [device, other], shape, dtype, measure=measure, window=2048)
    assert mixed.origin == "measured" and asked == [([256, 1024, 2048], "eager")]
    one = store.resolve(None, [device, device], shape, dtype, measure=measure, need=64)
    assert one.origin == "loaded" and one.path == kept.path and len(asked) == 1
    assert store.contexts_for(None) == list(store.DEFAULT_CONTEXTS)
    assert store.contexts_for(300, window=200) == [64, 200]


def test_a_paged_profile_is_measured_over_pages_keyed_and_priced_apart(model, dirs):
    """``kv="paged"``: measured over a PagedKVCache whose rows hold distinct pages, one run
    each, as the block manager hands them out on an empty pool; the layout
    is recorded and keyed, a run over fixed slots never picks it up, and a paged run's lookup
    finds it with its batch siblings of the same layout only."""
    repo, _ = dirs
    repo.mkdir(parents=True, exist_ok=True)
    cache = profile_cache(model, 3, 40, kv="paged", page=8)
    assert isinstance(cache, PagedKVCache) and cache.capacity >= 40
    owned = [p for row in cache.pages for p in row]
    assert len(owned) == len(set(owned)) == 3 * 5 and SCRATCH not in owned
    assert cache.pages == [list(range(1 + 5 * r, 6 + 5 * r)) for r in range(3)]
    assert all(cache.consecutive)
    fixed = measure(model, [16], batch=1, max_q=2, repeats=1)
    paged = [measure(model, [16], batch=b, max_q=2, repeats=1, kv="paged", page=8)
             for b in (1, 4)]
    for p in [fixed, *paged]:
        p.save(repo / f"{p.key()}.json")
    assert paged[0].kv == "paged" and paged[0].key() == fixed.key() + "__paged"
    assert LatencyProfile.load(repo / f"{paged[1].key()}.json").kv == "paged"
    data = fixed.to_json()
    del data["kv"]  # measured before the field: over fixed slots
    assert LatencyProfile.from_json(data).kv == "fixed"
    with pytest.raises(ValueError, match="'kv' must be one of"):
        LatencyProfile.from_json({**data, "kv": "ring"})
    device, shape = fixed.device, fixed.model
    found = store.lookup(None, [device], shape, "fp32", need=16)
    assert found.profile.kv == "fixed" and found.siblings == []
    found = store.lookup(None, [device], shape, "fp32", need=16, kv="paged")
    assert found.profile.kv == "paged" and [s.batch for s in found.siblings] == [4]
    assert {s.kv for s in found.siblings} == {"paged"}
    for p in paged:  # only the fixed-slot profile left: a starting point for a paged run
        (repo / f"{p.key()}.json").unlink()
    assert store.lookup(None, [device], shape, "fp32", need=16, kv="paged") is None
    found = store.lookup(None, [device], shape, "fp32", need=16, kv="paged", borrow=True)
    assert found.path.endswith(f"{fixed.key()}.json") and found.origin == "borrowed"
    assert found.profile.kv == "paged"  # relabelled for the run: its refits are over pages
    assert found.profile.mlp == fixed.mlp and found.profile.verify == fixed.verify


def test_a_profile_batch_the_memory_cannot_hold_is_refused_with_what_fits(model, monkeypatch):
    monkeypatch.setattr(profiler, "free_bytes", lambda device: 10 ** 6)
    per_token = kv_bytes_per_token(model)
    fits = int(0.9 * 10 ** 6) // (per_token * 64)
    with pytest.raises(UserError, match=f"batch 64 with contexts up to 1027 positions .* holds "
                                        f"{fits} positions a row"):
        measure(model, [1024], batch=64, max_q=3, repeats=1)
