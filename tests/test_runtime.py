"""The Ray engine on a real local Ray cluster (4 logical CPUs, gloo, 1 thread per rank).

* tp=2 gives the same greedy tokens as tp=1 for ar, static and knapspec (a given profile,
  then one the coordinator has the shards measure because none is stored);
* replicas=2 x tp=1 spreads text prompts over both replicas and returns results in input
  order, with text filled; a replica whose shard died fails its requests with the actor
  error, and restart_replica brings it back;
* paged KV under tp=2: the ranks, with different free memory, hold the smallest pool and
  give fixed slots' tokens (ar, knapspec; greedy, seeded); a row bigger than the pool is its
  own error; a fault mid-round fails its rows and every page comes back; a job stopped early
  after a replica restart leaves every page free;
* indivisible heads, a missing checkpoint, a rank that dies while starting (a shard class
  of tests/faults.py) and a replica that cannot be placed each raise a clear error and
  leave no actor or placement group.
"""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import torch
from ray._private import state

from knapspec_dist.cli.main import main
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.memory import kv_bytes_per_token_of
from knapspec_dist.engine.sampling import SamplingConfig
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.errors import UserError
from knapspec_dist.jobs.runner import default_engine_factory, run_job
from knapspec_dist.model.tokenizer import encode
from knapspec_dist.profiles import LatencyProfile
from knapspec_dist.runtime import StartupError, replica
from knapspec_dist.runtime import cluster as ray_cluster
from knapspec_dist.runtime.coordinator import Coordinator
from knapspec_dist.runtime.messages import KVPages, MeasureOptions
from knapspec_dist.runtime.ray_engine import RayEngine
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.speculation.options import StrategyOptions

from conftest import random_prompt
from fakes import docs_of, fake_tools, job, read_rows, write_input
from faults import FAIL_TOKEN, FREE, RankOneDiesAtSetup, UnevenMemory, dies_once_busy
from synthetic import drafting_profile

pytestmark = pytest.mark.processes  # a local Ray and its actors

ray = pytest.importorskip("ray")

NEW = 12
NO_EOS = dict(max_new_tokens=NEW, stop_at_eos=False)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ["OMP_NUM_THREADS"] = "1"
    # no stored profile can match: the knapspec test below must measure one
    os.environ["KNAPSPEC_PROFILES"] = str(tmp_path_factory.mktemp("profiles"))
    os.environ["KNAPSPEC_PROFILE_CACHE"] = str(tmp_path_factory.mktemp("profile-cache"))
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def leftovers() -> list[str]:
    """RayEngine actors not DEAD and engine placement groups not REMOVED, by name."""
    left = [f"actor {a.get('Name')} {a.get('State')}" for a in state.actors().values()
            if (a.get("Name") or "").startswith("knapspec-") and a.get("State") != "DEAD"]
    left += [f"placement group {p.get('name')} {p.get('state')}"
             for p in ray.util.placement_group_table().values()
             if (p.get("name") or "").startswith("knapspec-") and p.get("state") != "REMOVED"]
    return left


def local_tokens(model, strategy, prompts, **options) -> list[list[int]]:
    s = build_strategy(StrategyOptions(name=strategy, **options), model)
    config = GenerationConfig(max_new_tokens=NEW, stop_at_eos=False)
    return [generate(s, model, [p], config)[0].token_ids for p in prompts]


def test_tp2_engine_tokens_equal_tp1(cluster, checkpoints, engine_model, tmp_path):
    model = engine_model("llama-gqa")
    prompts = [random_prompt(n, model.cfg.vocab_size, seed=40 + n) for n in (5, 11)]
    profile = tmp_path / "profile.json"  # named by path: it prices tp=1 and tp=2 alike
    drafting_profile(model.cfg.shape()).save(profile)
    runs = [("ar", {}), ("static", dict(skip="m1,a2", gamma=3, tau_conf=0.0)),
            ("knapspec", dict(profile=str(profile), interval=8, tau_conf=0.0))]
    with RayEngine(str(checkpoints["llama-gqa"]), tp=2, strategy="ar") as engine:
        for i, (name, options) in enumerate(runs):
            if i:
                engine.reconfigure(StrategyOptions(name=name, **options))
            if name == "ar":  # a bad row fails on every rank alike; the replica lives on
                too_long = [5] * model.cfg.max_position_embeddings
                with pytest.raises(UserError, match="context window"):
                    ray.get(engine.submit(0, too_long, GenerationConfig(max_new_tokens=2)))
            results = engine.generate(prompts, **NO_EOS)
            expected = local_tokens(model, name, prompts, **options)
            assert [r.token_ids for r in results] == expected, name
            for r in results:
                p = r.stats.split
                assert r.replica == 0 and p.comm_calls > 0 and p.comm_s > 0 and p.ray_s > 0
                assert p.compute_s > 0 and p.other_s >= 0
            if name == "knapspec":
                assert all(r.stats.selections >= 1 for r in results)
                assert sum(r.stats.drafted for r in results) > 0
        job = engine.last_job
        assert 0 <= job["control_plane_share"] <= 1 and job["comm_share"] > 0
        # No stored profile matches: the shards measure one (with the all-reduce, at tp=2).
        engine.measure = MeasureOptions((16, 64), repeats=1)
        engine.reconfigure(StrategyOptions(name="knapspec", interval=8))
        info = engine.replica_info(0)
        assert info.profile["origin"] == "measured", info
        assert info.profile_key.endswith("tp2__eager__paged"), info  # over the replica's pages
        results = engine.generate(prompts, **NO_EOS)
        assert [r.token_ids for r in results] == local_tokens(model, "ar", prompts)
    assert leftovers() == []


PAGED_LENGTHS = (5, 40, 11, 70, 23, 3)  # 3 + 5 + 3 + 7 + 4 + 3 pages: more than the pool


@pytest.mark.e2e
def test_tp2_ranks_hold_the_smallest_pool_and_page_like_fixed_slots(cluster, checkpoints,
                                                                    engine_model, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setattr(replica, "Shard", UnevenMemory)
    ckpt = str(checkpoints["llama-gqa"])
    model = engine_model("llama-gqa")
    per_token = kv_bytes_per_token_of(model.cfg, 2, torch.float32)
    pages = int(0.9 * min(FREE.values())) // (per_token * 16) - 1  # rank 1's, less scratch
    free = [KVPages(0, pages, pages), KVPages(1, pages, pages)]
    prompts = [random_prompt(n, model.cfg.vocab_size, seed=60 + n) for n in PAGED_LENGTHS]
    assert all(p[0] != FAIL_TOKEN for p in prompts)
    profile = tmp_path / "profile.json"
    drafting_profile(model.cfg.shape()).save(profile)
    runs = [("ar", {}), ("knapspec", dict(profile=str(profile), interval=8, tau_conf=0.0))]
    configs = [GenerationConfig(**NO_EOS), GenerationConfig(
        **NO_EOS, sampling=SamplingConfig(temperature=0.9, seed=5))]
    with RayEngine(ckpt, tp=2, strategy="ar") as engine:
        kv = engine.replica_info(0).kv
        assert kv.paged and (kv.pages, kv.page, kv.max_num_seqs) == (pages, 16, 16)
        assert engine.kv_pages() == free
        for i, (name, options) in enumerate(runs):
            if i:
                engine.reconfigure(StrategyOptions(name=name, **options))
            for config in configs:
                got = [r.token_ids for r in engine.generate(prompts, config)]
                fixed = generate(build_strategy(StrategyOptions(name=name, **options), model),
                                 model, prompts, config, max_num_seqs=2)
                assert got == [r.token_ids for r in fixed], (name, config.sampling)
                assert engine.kv_pages() == free, name  # the same pool after reconfigure
        report = engine.kv_report()
        assert report.pages == pages and 2 <= report.peak_rows and report.mean_rows > 1
        assert report.peak_tokens <= report.tokens and report.rows_waited > 0
        assert report.memory_wait_s > 0
        big = random_prompt(300, model.cfg.vocab_size, seed=3)
        with pytest.raises(UserError, match=rf"prompt of 300 tokens with {NEW} new tokens "
                                            rf"needs {300 + NEW + 18} cache positions; the KV "
                                            rf"pool holds {pages * 16}"):
            ray.get(engine.submit(0, big, configs[0]))
        with pytest.raises(Exception, match="injected fault mid-round"):
            engine.generate([[FAIL_TOKEN, 5, 6]] + prompts[:2], configs[0])
        assert engine.kv_pages() == free
        again = engine.generate(prompts, configs[0])
        assert [r.token_ids for r in again] == local_tokens(model, "ar", prompts)
        assert engine.kv_pages() == free
    assert leftovers() == []


@pytest.mark.e2e
def test_a_job_stopped_early_after_a_replica_restart_leaves_every_page_free(cluster,
                                                                            checkpoints,
                                                                            tmp_path,
                                                                            monkeypatch):
    """A job on the real engine: its rank dies with rows in flight, the replica is
    restarted and the rows retried, the job stops after 4 of 6 rows; as the engine shuts
    down, every rank's pages are free, and the summary reports the pool."""
    monkeypatch.setattr(replica, "Shard", dies_once_busy(str(tmp_path / "died")))
    write_input(tmp_path / "in.parquet", list("abcdef"), docs_of([5, 30, 9, 3, 20, 12]))
    pages = []

    class Checked:
        def __init__(self, engine):
            self.engine = engine

        def __enter__(self):
            return self.engine

        def __exit__(self, *exc):
            try:
                pages.append(self.engine.kv_pages())
            finally:
                self.engine.shutdown()

    def factory(config, strategy, replicas):
        return Checked(default_engine_factory(config, strategy, replicas, longest=64))

    config = job(tmp_path, model=str(checkpoints["llama-gqa"]), strategy="ar",
                 baseline_fraction=0, stop_after=4,
                 kv_cache_memory=13 * 16 * 1024)  # 12 pages of 16 and the scratch page
    result = run_job(config, engine_factory=factory, text_tools=fake_tools(64))
    assert (tmp_path / "died").exists()
    assert result.replica_restarts == 1 and result.stopped_early
    assert len(read_rows(result.output)) == 4
    assert pages == [[KVPages(0, 12, 12)]]
    kv = result.summary["kv_cache"]
    assert kv["paged"] and (kv["pages"], kv["page_size"], kv["tokens"]) == (12, 16, 192)
    assert kv["peak_rows"] >= 1 and kv["peak_tokens"] <= 192
    assert leftovers() == []


@pytest.mark.e2e
def test_replicas_spread_prompts_in_input_order(cluster, smollm2):
    texts = ["The capital of France is", "One, two, three,", "Water boils at",
             "The quick brown fox", "In the beginning"]
    ids = [encode(smollm2.tokenizer, t) for t in texts]
    expected = local_tokens(smollm2.model, "ar", ids)
    with RayEngine("smollm2", tp=1, replicas=2, strategy="ar") as engine:
        results = engine.generate(texts, **NO_EOS)
        assert [r.replica for r in results] == [0, 1, 0, 1, 0]
        assert [r.token_ids for r in results] == expected
        assert [r.text for r in results] == [smollm2.tokenizer.decode(t, skip_special_tokens=True)
                                             for t in expected]
        assert engine.last_job["replicas_used"] == 2
        # A bad row fails alone, with its own error.
        config = GenerationConfig(**NO_EOS)
        with pytest.raises(UserError, match="outside the vocabulary"):
            ray.get(engine.submit(0, [10 ** 9], config))
        # A dead shard fails the replica's requests with the actor error; restart heals it.
        ray.kill(engine._replicas[1].shards[0], no_restart=True)
        with pytest.raises(ray.exceptions.RayError) as info:
            ray.get(engine.submit(1, ids[0], config), timeout=60)
        assert _dead_actor(info.value), repr(info.value)
        engine.restart_replica(1)
        assert ray.get(engine.submit(1, ids[0], config)).token_ids == expected[0]
    assert leftovers() == []


def _dead_actor(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ray.exceptions.RayActorError):
            return True
        exc = getattr(exc, "cause", None) or exc.__cause__
    return False


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["indivisible", "missing", "rank-dies", "unplaceable"])
def test_startup_failures_leave_nothing_behind(cluster, checkpoints, tmp_path, case,
                                               monkeypatch):
    ckpt = str(checkpoints["llama-gqa"])  # 4 heads, 2 KV heads
    kwargs, error, match = {
        "indivisible": (dict(model=ckpt, tp=4), UserError, "KV heads 2 not divisible by 4"),
        "missing": (dict(model=str(tmp_path / "nope")), UserError, "does not exist"),
        "rank-dies": (dict(model=ckpt, tp=2), StartupError,
                      "replica 0 rank 1 failed to load its shard: its actor died"),
        # the cluster's resources are checked before any placement group is asked for
        "unplaceable": (dict(model=ckpt, tp=2, cpus_per_rank=3, startup_timeout_s=3),
                        StartupError, r"tp 2 x replicas 1 needs 6 CPU\(s\) \(3 per rank\); "
                                      r"the Ray cluster has 4"),
    }[case]
    if case == "rank-dies":
        monkeypatch.setattr(replica, "Shard", RankOneDiesAtSetup)
    with pytest.raises(error, match=match):
        RayEngine(strategy="ar", **kwargs)
    assert leftovers() == []


def test_cli_generate_tp_goes_through_the_engine(cluster, checkpoints, capsys):
    code = main(["generate", "--model", str(checkpoints["llama-gqa"]), "--prompt", "hi",
                 "--tp", "4", "--strategy", "ar"])
    assert code == 2
    assert "error: cannot shard the model over tp=4" in capsys.readouterr().err
    assert leftovers() == []


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_profile_tp2_measures_the_allreduce(cluster, checkpoints, tmp_path, capsys):
    code = main(["profile", "--model", str(checkpoints["llama-gqa"]), "--tp", "2",
                 "--contexts", "16,32", "--repeats", "1", "--max-q", "2",
                 "--out", str(tmp_path) + "/"])
    assert code == 0, capsys.readouterr().err
    (path,) = tmp_path.glob("*.json")
    profile = LatencyProfile.load(path)
    assert profile.tp == 2 and profile.allreduce > 0 and profile.samples["allreduce"]
    assert "all-reduce per sublayer" in capsys.readouterr().out
    assert leftovers() == []


@pytest.mark.parametrize("message, level", [
    ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled ...",
     logging.INFO),
    ("Token authentication is disabled for this Ray cluster. Anyone with network ...",
     logging.WARNING),
])
def test_rays_token_auth_default_is_info_and_its_disabled_warning_stays(message, level):
    """The demo printed Ray's "Token authentication is enabled" as its one WARNING line."""
    record = logging.LogRecord(ray_cluster.RAY_AUTH_LOG, logging.WARNING, __file__, 1, message,
                               None, None)
    ray_cluster._AUTH_FILTER.filter(record)
    assert record.levelno == level and record.levelname == logging.getLevelName(level)


def test_ranks_share_the_clusters_cores_unless_told():
    """A replica's ranks get every core of a 2-core node; ranks of several replicas share the
    cluster's; a replica's tp ranks fit its largest node; CPUs another engine holds are not
    shared again; never less than one."""
    share = replica.share_cores
    assert share([2], 2, tp=1, replicas=1) == 2
    assert share([2], 2, tp=2, replicas=1) == 1
    assert share([2], 2, tp=1, replicas=2) == 1
    assert share([16, 16], 32, tp=4, replicas=2) == 4
    assert share([8, 2], 10, tp=2, replicas=1) == 4
    assert share([2], 2, tp=4, replicas=1) == 1
    assert share([3], 1, tp=1, replicas=1) == 1  # two of three held by another engine
    assert share([], 0, tp=1, replicas=1) == 1


@pytest.mark.parametrize("stopping", [False, True], ids=["a-crash", "the-engine-stops-it"])
def test_ranks_the_engine_kills_are_no_error_of_the_replica(caplog, stopping):
    """Dead ranks are an ERROR of the replica, unless the engine said it is stopping it (a
    restart, the job's end): then they are the engine's doing and the coordinator is quiet."""
    coordinator = Coordinator(0, "model", 10, 2, "fp32")
    coordinator.grace_s = 0.01
    if stopping:
        coordinator.stop()

    async def killed():
        raise ray.exceptions.RayActorError()

    async def gather():
        with pytest.raises(ray.exceptions.RayActorError):
            await coordinator._gather([killed(), killed()])

    with caplog.at_level(logging.DEBUG, logger="knapspec_dist.runtime.coordinator"):
        asyncio.run(gather())
    inconsistent = [r for r in caplog.records if "failed inconsistently" in r.getMessage()]
    assert [r.levelno for r in inconsistent] == [logging.DEBUG if stopping else logging.ERROR]
