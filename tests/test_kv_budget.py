"""The KV budget of a replica (engine/memory.py's ``plan_kv``), without Ray: how free memory
and the user's options become pages and a row cap, the smallest plan over TP ranks, the
halving after out of memory, the refusals before any replica starts, the options from the
command line, and what a scheduler reports of its pool's use."""

from __future__ import annotations

import argparse

import pytest
import torch

from knapspec_dist.cli.job import add_job_args, config_from_args
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.memory import (
    CPU_CAP,
    GPU_CAP,
    KVBudget,
    kv_bytes_per_token_of,
    plan_kv,
    slot_size,
)
from knapspec_dist.engine.pages import CPU_PAGE, FLEX_PAGE, KVUse, Paging, page_size
from knapspec_dist.engine.scheduler import Scheduler, Work
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.errors import UserError
from knapspec_dist.jobs import JobConfig
from knapspec_dist.model.attention import FLEX_BLOCK
from knapspec_dist.model.config import load_config
from knapspec_dist.model.embedded import resolve_model_path
from knapspec_dist.runtime import ray_engine
from knapspec_dist.runtime.messages import Admission, KVReport, ReplicaBudget, ReplicaInfo
from knapspec_dist.runtime.processor import ProcessorConfig
from knapspec_dist.runtime.setup import check_kv, check_kv_memory
from knapspec_dist.runtime.shard import Shard
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.options import StrategyOptions

from batching import mixed_prompts
from conftest import random_prompt

pytestmark = pytest.mark.processes  # a local Ray and its actors

PER_TOKEN = 1000  # bytes a position, made up: every number below follows from it


def paged(**kw) -> KVBudget:
    args = dict(per_token=PER_TOKEN, free=10 ** 9, capacity=300, paged=True, cuda=False)
    return plan_kv(**{**args, **kw})


def test_the_free_memory_or_the_given_bytes_become_whole_pages():
    # 0.9 of 1 MB free: 900 positions, 56 whole pages of 16, one of them the scratch page
    assert paged(free=10 ** 6) == KVBudget(True, CPU_PAGE, 55, PER_TOKEN, CPU_CAP, 300)
    assert paged(free=10 ** 6, memory_utilization=0.5).pages == 500 // CPU_PAGE - 1
    given = paged(free=1, kv_cache_memory=160_000)  # the free memory no longer counts
    # the cache takes the bytes given, no more: 9 pages for rows and the scratch page
    assert (given.pages, given.tokens, given.bytes) == (9, 144, 160_000)
    assert paged(free=1, kv_cache_memory=160_000 - 1).bytes == 144_000
    cuda = paged(free=10 ** 6, cuda=True)
    assert (cuda.page, cuda.pages, cuda.max_num_seqs) == (FLEX_PAGE, 6, GPU_CAP)


def test_max_num_seqs_only_caps_the_rows_and_bounds_the_pool_they_could_fill():
    big = paged()  # 900 MB: far more than 16 rows of 300 positions fill
    assert big.max_num_seqs == CPU_CAP and big.pages == CPU_CAP * 19  # 19 pages hold 300
    assert paged(max_num_seqs=3).pages == 3 * 19
    small = paged(free=10 ** 6, max_num_seqs=100)  # the cap is not cut to what fits
    assert small.max_num_seqs == 100 and small.pages == 55


def test_fixed_slots_cut_the_budget_into_rows_of_the_slot_size():
    slot = slot_size(300)
    assert slot == 512  # model_runner's rounding
    fixed = plan_kv(per_token=PER_TOKEN, free=0, capacity=300, paged=False, cuda=False,
                    kv_cache_memory=3 * slot * PER_TOKEN + 1)
    assert (fixed.pages, fixed.max_num_seqs, fixed.tokens, fixed.page) == (3, 3, 3 * slot, slot)
    assert fixed.paging() is None and fixed.bytes == 3 * slot * PER_TOKEN
    assert plan_kv(per_token=PER_TOKEN, free=10 ** 12, capacity=300, paged=False,
                   cuda=False).max_num_seqs == CPU_CAP


def test_a_page_is_one_flex_key_block_under_flex():
    assert (page_size("flex"), page_size("sdpa")) == (FLEX_BLOCK, CPU_PAGE)


def test_every_rank_gets_the_smallest_plan_and_halving_keeps_one_row():
    ranks = [paged(free=2 * 10 ** 6), paged(free=15 * 10 ** 5, max_num_seqs=5)]
    agreed = KVBudget.least(ranks)  # 111 and 83 pages of 16 (and the scratch page each)
    assert (agreed.pages, agreed.max_num_seqs, agreed.page) == (83, 5, CPU_PAGE)
    assert agreed.paging() == Paging(83 * CPU_PAGE, CPU_PAGE)
    memory, seqs = agreed.halved()
    assert (memory, seqs) == (42 * CPU_PAGE * PER_TOKEN, 2)  # 41 pages and the scratch page
    assert paged(free=1, kv_cache_memory=memory).pages == 41
    tiny = paged(free=1, kv_cache_memory=20 * CPU_PAGE * PER_TOKEN, max_num_seqs=1)
    assert tiny.pages == 19 and tiny.holds(300)
    assert tiny.halved() == (20 * CPU_PAGE * PER_TOKEN, 1)  # still one row of 300


def test_a_budget_without_room_for_one_row_of_max_model_len_is_refused():
    budget = ReplicaBudget(row_capacity(250, 0), kv_cache_memory=200_000, max_model_len=250)
    kv = paged(free=1, kv_cache_memory=200_000, capacity=budget.capacity)
    with pytest.raises(UserError, match=r"the KV cache holds 176 tokens per rank "
                                        r"\(--kv-cache-memory 200000 bytes\); one row of "
                                        r"--max-model-len 250 needs 268 tokens"):
        check_kv(kv, budget)
    check_kv(kv, ReplicaBudget(budget.capacity, kv_cache_memory=200_000))  # a row's error


def test_the_job_refuses_a_kv_cache_memory_too_small_from_the_model_config():
    config = load_config(resolve_model_path("smollm2"))
    per_token = kv_bytes_per_token_of(config, 1, torch.float32)
    need = row_capacity(8192, 0)
    budget = ReplicaBudget(need, kv_cache_memory=2 ** 20, max_model_len=8192)
    pages = 2 ** 20 // (per_token * CPU_PAGE) - 1  # the scratch page is in the budget
    with pytest.raises(UserError, match=rf"holds {pages * CPU_PAGE} tokens per rank "
                                        rf"\(--kv-cache-memory 1048576 bytes \(1.0 MiB\)\).* "
                                        rf"needs {need} tokens"):
        check_kv_memory(config, 1, "fp32", "cpu", budget, None)
    check_kv_memory(config, 1, "fp32", "cpu", ReplicaBudget(need, max_model_len=8192), None)
    roomy = ReplicaBudget(need, kv_cache_memory=need * per_token * 2, max_model_len=8192)
    check_kv_memory(config, 1, "fp32", "cpu", roomy, None)
    with pytest.raises(UserError, match="of the largest node's memory"):  # the default share
        check_kv_memory(config, 1, "fp32", "cpu", ReplicaBudget(need, max_model_len=8192),
                        2 * need * per_token)


def test_memory_options_from_the_command_line_and_the_processor():
    p = argparse.ArgumentParser()
    add_job_args(p)
    args = p.parse_args(["--input", "i", "--output", "o", "--kv-cache-memory", "2GiB",
                         "--memory-utilization", "0.5", "--max-num-seqs", "64"])
    c = config_from_args(args)
    assert (c.kv_cache_memory, c.memory_utilization, c.max_num_seqs) == (2 ** 31, 0.5, 64)
    assert "kv_cache_memory" not in c.fingerprint()  # where it runs, not what it writes
    assert config_from_args(p.parse_args(["--input", "i", "--output", "o"])).kv_cache_memory \
        is None
    with pytest.raises(UserError, match="--kv-cache-memory must be a size"):
        JobConfig(input="i", output="o", kv_cache_memory="lots")
    with pytest.raises(UserError, match=r"--memory-utilization must be a finite number in "
                                        r"\(0, 1\]"):
        JobConfig(input="i", output="o", memory_utilization=1.5)
    assert ProcessorConfig(kv_cache_memory="1MiB").kv_cache_memory == 2 ** 20
    with pytest.raises(UserError, match="--memory-utilization"):
        ProcessorConfig(memory_utilization=0)


def test_a_replica_restarted_after_out_of_memory_gets_half_its_kv_cache(monkeypatch):
    """RayEngine.restart_replica(smaller=True), Ray left out: the budget it starts the
    replica with holds half the pool and half the rows, and that replica keeps it."""
    started = []
    monkeypatch.setattr(ray_engine, "stop_replica", lambda rep: None)
    monkeypatch.setattr(ray_engine, "start_replicas", lambda spec, indices, options, measure,
                        budget: started.append(budget) or [FakeReplica(budget)])
    engine = object.__new__(ray_engine.RayEngine)
    engine.num_replicas, engine.spec, engine.options, engine.measure = 1, None, None, None
    engine.budget, engine._budget_of = ReplicaBudget(300, max_model_len=250), {}
    kv = paged(free=10 ** 6)
    engine._replicas = [FakeReplica(engine.budget, kv)]
    engine.restart_replica(0, smaller=True)
    half = (kv.pages // 2 + 1) * CPU_PAGE * PER_TOKEN  # half the pages, and the scratch page
    assert started[-1] == ReplicaBudget(300, CPU_CAP // 2, half, max_model_len=250)
    engine.restart_replica(0)  # a plain restart keeps the smaller budget
    assert started[-1] == started[-2]


class FakeReplica:
    def __init__(self, budget, kv=None):
        self.index, self.budget = 0, budget
        self.info = ReplicaInfo(0, kv=kv or paged(free=1, kv_cache_memory=budget.kv_cache_memory
                                                   or 10 ** 6))


def test_the_report_of_replicas_takes_the_smallest_pool_and_the_peaks():
    a, b = paged(free=10 ** 6), paged(free=5 * 10 ** 5)
    infos = [ReplicaInfo(0, kv=a, use=KVUse(480, 4, 1.5, 2), work=Work(rounds=10, row_rounds=30)),
             ReplicaInfo(1, kv=b, use=KVUse(400, 6, 0.5, 1), work=Work(rounds=10, row_rounds=10)),
             ReplicaInfo(2)]  # not prepared yet: no cache
    r = KVReport.of(infos)
    assert (r.pages, r.tokens, r.peak_tokens, r.peak_rows) == (b.pages, b.tokens, 480, 6)
    assert r.peak_use == pytest.approx(400 / b.tokens) and r.mean_rows == 2.0
    assert (r.memory_wait_s, r.rows_waited) == (2.0, 3)
    assert KVReport.of([ReplicaInfo(0)]) is None
    assert set(r.to_dict()) >= {"paged", "page_size", "pages", "tokens", "bytes", "peak_use",
                                "peak_rows", "mean_rows", "memory_wait_s"}


class TickClock:
    """Each reading one second later: a wait shows as seconds, whatever the machine."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        self.t += 1.0
        return self.t

    mark = now

    def seconds(self, a, b) -> float:
        return b - a

    def sync(self) -> None:
        pass


def test_a_scheduler_reports_its_peaks_and_the_rows_that_waited_for_pages(engine_model):
    model = engine_model("llama-gqa")
    config = GenerationConfig(max_new_tokens=4, stop_at_eos=False)
    ps = [random_prompt(n, model.cfg.vocab_size, seed=n) for n in (30, 10, 20)]
    needs = [row_capacity(len(p), 4) for p in ps]  # 52, 32, 42: 4, 2, 3 pages of 16
    one_at_a_time = Scheduler(Autoregressive(), model, config, 3, max(needs), clock=TickClock(),
                              paging=Paging(tokens=64, page=16))
    one_at_a_time.run(ps)
    use = one_at_a_time.use
    assert (use.peak_tokens, use.peak_rows, use.waited) == (64, 1, 2) and use.wait_s > 0
    roomy = Scheduler(Autoregressive(), model, config, 3, max(needs), clock=TickClock(),
                      paging=Paging(tokens=160, page=16))
    roomy.run(ps)
    assert roomy.use == KVUse(peak_tokens=(4 + 2 + 3) * 16, peak_rows=3)
    fixed = Scheduler(Autoregressive(), model, config, 2, max(needs), clock=TickClock())
    fixed.run(ps)  # slots, not pages: nobody waits for memory
    assert fixed.use == KVUse(peak_tokens=2 * fixed.capacity, peak_rows=2)


def test_a_shard_schedules_with_the_budget_its_config_carries(checkpoints, engine_model):
    """The budget crosses to a shard inside the GenerationConfig each ``advance`` gets (what a
    coordinator sends over Ray), and its rows get the tokens of an in-process run."""
    model = engine_model("llama-gqa")
    config = GenerationConfig(max_new_tokens=10, stop_at_eos=False, max_num_batched_tokens=5)
    ps = mixed_prompts(model.cfg.vocab_size, (9, 70, 23, 140, 4), seed=300)
    want = Scheduler(Autoregressive(), model, GenerationConfig(max_new_tokens=10,
                     stop_at_eos=False), 2, 256).run(ps)
    shard = Shard(0, 0, 1, 1, "cpu")
    shard.setup(str(checkpoints["llama-gqa"]), "", 0, "fp32")
    budget = ReplicaBudget(capacity=256, max_num_seqs=2)
    shard.configure(StrategyOptions(name="ar"), None, shard.plan_memory(budget))
    admit = [Admission(i, tuple(p), i) for i, p in enumerate(ps)]
    done = {}
    while len(done) < len(ps):
        out = shard.advance(config, admit, 1000, 2)
        admit = []
        assert not out.refused
        done.update(out.finished)
        assert shard.scheduler.max_num_batched_tokens == 5
    assert [done[i].token_ids for i in range(len(ps))] == [r.token_ids for r in want]
