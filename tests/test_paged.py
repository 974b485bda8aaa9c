"""The paged KV cache (model/paged_cache.py) and admission by pages (engine/pages.py,
engine/scheduler.py): the same bits as fixed slots, every page back after every way a row ends,
and the pool's invariants after every step of random workloads."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner, prefill
from knapspec_dist.engine.pages import PagePool, Paging
from knapspec_dist.engine.sampling import SamplingConfig
from knapspec_dist.engine.scheduler import Scheduler
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.errors import UserError
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.paged_cache import SCRATCH, PagedKVCache
from knapspec_dist.option_rules import parse_size
from knapspec_dist.speculation.autoregressive import Autoregressive

from batching import STRATEGIES, check_pool, mixed_prompts, run_rows, with_eos
from conftest import random_prompt
from synthetic import LINEAR_ATTENTION, synthetic_profile

NAME = "llama-gqa"
LENGTHS = (9, 70, 23, 140, 4, 51, 33)
PAGE = 16


def strategy(name: str, model):
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=100.0)
    return STRATEGIES[name](profile)


def capacity(ps, config) -> int:
    return max(row_capacity(len(p), config.max_new_tokens) for p in ps)


def assert_all_free(sched: Scheduler) -> None:
    pool = sched.batch.pool
    assert len(pool.free) == pool.total and pool.reserved == 0
    assert set(sched.batch.cache.table.flatten().tolist()) == {SCRATCH}


def test_paged_forwards_give_the_fixed_caches_bits(engine_model):
    """Rows of mixed lengths, one on consecutive pages (read in place) and two on scattered
    ones (gathered), prefilled in chunks, then verify-sized (T = 5, masked) and decode (T = 1,
    equal and unequal starts) forwards: logits bit for bit those of fixed slots."""
    model = engine_model(NAME)
    vocab, cap = model.cfg.vocab_size, 256
    seqs = mixed_prompts(vocab, (37, 5, 100))
    fixed = KVCache(model.cfg, 3, cap, dtype=model.dtype, device="cpu")
    paged = PagedKVCache(model.cfg, 3, cap, n_pages=60, page=PAGE, dtype=model.dtype,
                         device="cpu")
    order = list(range(17, 60))
    random.Random(3).shuffle(order)
    paged.assign(0, list(range(1, 17)))
    for row in (1, 2):
        paged.assign(row, order[row * 16:(row + 1) * 16])
    assert paged.consecutive == [True, False, False]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for cache in (fixed, paged):
            for row, s in enumerate(seqs):
                for at in range(0, len(s), 24):
                    prefill(model, cache, row, s[at:at + 24], at)
        for t, starts in ((5, None), (1, None), (1, [40, 40, 40])):
            tokens = torch.randint(vocab, (3, t), generator=g)
            outs = []
            for cache in (fixed, paged):
                for row, n in enumerate(starts or []):
                    cache.commit(row, n)
                outs.append(model(tokens, cache.lengths[:3], cache))
            assert torch.equal(outs[0], outs[1]), t
            for cache in (fixed, paged):
                for row in range(3):
                    cache.commit(row, cache.lengths[row] + t)
        for row in range(3):
            assert all(torch.equal(a, b) for a, b in zip(fixed.row_kv(1, row, fixed.lengths[row]),
                                                         paged.row_kv(1, row, paged.lengths[row])))


def test_a_row_gets_the_lowest_run_of_consecutive_free_pages(engine_model):
    """The block manager: the lowest run of free pages that holds a row, else the lowest free
    pages (the row is then gathered, not read in place); the same admissions, the same
    pages."""
    cfg = engine_model(NAME).cfg
    cache = PagedKVCache(cfg, 4, 64, n_pages=12, page=4, dtype=torch.float32, device="cpu")
    pool = PagePool(cache)
    for row, tokens in ((0, 12), (1, 8), (2, 16)):
        pool.admit(row, tokens)
    assert cache.pages[:3] == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    pool.release(1)
    assert pool.free == [4, 5, 10, 11]
    pool.admit(1, 12)  # no run of 3: the lowest three
    assert cache.pages[1] == [4, 5, 10] and cache.consecutive == [True, False, True, False]
    pool.release(0)
    pool.admit(3, 8)
    assert cache.pages[3] == [1, 2] and cache.consecutive[3] and pool.free == [3, 11]
    cache.move_row(3, 0)
    assert cache.consecutive == [True, False, True, False]
    slots, gather, offsets = cache.locate(slice(0, 3), torch.tensor([[0], [0], [0]]), 16,
                                          (5, 9, 16))
    assert offsets == (4, None, 24) and gather.tolist() == [16, 17, 18, 19, 20, 21, 22, 23, 40]


SAMPLED = GenerationConfig(max_new_tokens=16, stop_at_eos=False,
                           sampling=SamplingConfig(temperature=0.9, seed=5))
GREEDY = GenerationConfig(max_new_tokens=16, stop_at_eos=False)


@pytest.mark.parametrize("config", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_paged_rows_get_the_tokens_of_fixed_slots(engine_model, name, config):
    """More rows than slots, mixed lengths, prompts prefilled in 16-token chunks, admission
    waiting for pages: every row's tokens equal fixed slots', and every page comes back."""
    model = engine_model(NAME)
    ps = mixed_prompts(model.cfg.vocab_size)
    cap = capacity(ps, config)
    fixed = Scheduler(strategy(name, model), model, replace(config, max_num_batched_tokens=16),
                      2, cap)
    want = run_rows(fixed, ps)
    paging = Paging(tokens=2 * cap, page=PAGE)  # what the fixed cache's 2 slots hold
    paged = Scheduler(strategy(name, model), model, replace(config, max_num_batched_tokens=16),
                      6, cap,
                      paging=paging)
    got = run_rows(paged, ps, checked=True)
    assert [r.out for r in got] == [r.out for r in want]
    assert_all_free(paged)
    assert paged.work.mean_batch > fixed.work.mean_batch  # the pages' point
    if name == "knapspec":
        assert sum(r.stats.drafted for r in got) > 0, "speculation never ran"


def test_admission_is_first_come_first_served(engine_model):
    """A long row at the head waits for pages while short ones behind it could fit: they
    wait too, so rows start in the order they came."""
    model = engine_model(NAME)
    config = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    ps = mixed_prompts(model.cfg.vocab_size, (20, 150, 5, 6, 7))
    cap = capacity(ps, config)
    sched = Scheduler(Autoregressive(), model, config, 5, cap,
                      paging=Paging(tokens=cap + 16, page=PAGE))
    rows = run_rows(sched, ps, checked=True)
    starts = [r.admitted_s for r in rows]
    assert starts == sorted(starts)
    assert rows[2].admitted_s >= rows[0].finished_s  # the 150-token row held it back
    assert_all_free(sched)


def test_a_row_bigger_than_the_pool_is_refused_alone(engine_model):
    model = engine_model(NAME)
    config = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    sched = Scheduler(Autoregressive(), model, config, 4, 512,
                      paging=Paging(tokens=160, page=PAGE))
    sched.add(0, random_prompt(30, model.cfg.vocab_size, seed=1))
    with pytest.raises(UserError, match=r"prompt of 200 tokens .* 226 cache positions; the KV "
                                        r"pool holds 160"):
        sched.add(1, random_prompt(200, model.cfg.vocab_size, seed=2))
    done = []
    while sched.busy:
        done += sched.step()
    assert [r.rid for r in done] == [0] and len(done[0].out) == 8
    assert_all_free(sched)


def test_no_page_leaks_when_rows_end_by_eos_or_at_their_first_token(engine_model):
    model = engine_model(NAME)
    ps = mixed_prompts(model.cfg.vocab_size)
    cap = capacity(ps, GREEDY)
    paging = Paging(tokens=3 * cap, page=PAGE)
    plain = run_rows(Scheduler(Autoregressive(), model, GREEDY, 4, cap, paging=paging), ps)
    eos = plain[1].out[5]  # ends row 1 (and maybe others) early
    first = plain[2].out[0]  # ends row 2 at its first token
    for token in (eos, first):
        m = with_eos(model, token)
        config = GenerationConfig(max_new_tokens=16, stop_at_eos=True)
        sched = Scheduler(Autoregressive(), m, config, 4, cap, paging=paging)
        rows = run_rows(sched, ps, checked=True)
        assert {r.reason for r in rows} == {"eos", "length"}
        assert_all_free(sched)
    assert len(rows[2].out) == 1 and rows[2].reason == "eos"
    one = GenerationConfig(max_new_tokens=1, stop_at_eos=False)  # every row done at once
    sched = Scheduler(Autoregressive(), model, one, 4, cap, paging=paging)
    assert all(len(r.out) == 1 for r in run_rows(sched, ps, checked=True))
    assert_all_free(sched)


class Boom(Exception):
    pass


class FailingRounds(Autoregressive):
    def __init__(self, fail_at: int):
        super().__init__()
        self.rounds, self.fail_at = 0, fail_at

    def round(self, *args):
        self.rounds += 1
        if self.rounds == self.fail_at:
            raise Boom()
        super().round(*args)


def test_a_scheduler_rebuilt_after_a_failed_round_starts_with_every_page_free(engine_model):
    """A round raises with rows holding pages; the next scheduler on the same runner (and
    cache) starts from a full pool and gives the tokens of a fresh one."""
    model = engine_model(NAME)
    ps = mixed_prompts(model.cfg.vocab_size)
    cap = capacity(ps, GREEDY)
    paging = Paging(tokens=3 * cap, page=PAGE)
    runner = ModelRunner(model)
    broken = Scheduler(FailingRounds(5), model, GREEDY, 4, cap, runner=runner, paging=paging)
    with pytest.raises(Boom):
        run_rows(broken, ps)
    assert broken.batch.pool.reserved > 0
    again = Scheduler(Autoregressive(), model, GREEDY, 4, cap, runner=runner, paging=paging)
    assert again.batch.cache is broken.batch.cache
    assert_all_free(again)
    got = run_rows(again, ps, checked=True)
    fresh = run_rows(Scheduler(Autoregressive(), model, GREEDY, 4, cap, paging=paging), ps)
    assert [r.out for r in got] == [r.out for r in fresh]
    assert_all_free(again)


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_keep_the_pool_consistent(engine_model, seed):
    """Rows of random lengths added between random numbers of steps, speculation rolling
    drafts back: the invariants after every step, every page free at the end."""
    model = engine_model(NAME)
    rng = random.Random(seed)
    config = GenerationConfig(max_new_tokens=rng.choice((3, 9, 20)), stop_at_eos=False)
    name = ("ar", "static")[seed % 2]
    paging = Paging(tokens=rng.choice((160, 240, 400)), page=rng.choice((8, 16, 32)))
    chunked = replace(config, max_num_batched_tokens=rng.choice((16, 64)))
    sched = Scheduler(strategy(name, model), model, chunked, rng.choice((2, 3, 5)), 512,
                      paging=paging)
    pool_tokens = sched.batch.pool.tokens
    added = 0
    for _ in range(40):
        for _ in range(rng.choice((0, 0, 1, 2))):
            n = rng.randint(1, 130)
            if row_capacity(n, config.max_new_tokens) <= pool_tokens:
                sched.add(added, random_prompt(n, model.cfg.vocab_size, seed=added))
                added += 1
        for _ in range(rng.randint(0, 3)):
            sched.step()
            check_pool(sched)
    while sched.busy:
        sched.step()
        check_pool(sched)
    assert added > 5 and sched.work.finished == added * config.max_new_tokens
    assert_all_free(sched)


@pytest.mark.parametrize("name", ["ar", "static"])
def test_static_shape_forwards_over_pages_give_fixed_slots_tokens(engine_model, name):
    """The graph path (device starts, every ``capacity`` key read, replayed through the
    runner's graph stand-in) over pages, with admissions and retires between rounds: fixed
    slots' tokens on the same path, and the graphs captured once per shape, not per row."""
    model = engine_model(NAME)
    ps = mixed_prompts(model.cfg.vocab_size)
    cap = capacity(ps, GREEDY)
    outs = []
    for paging in (None, Paging(tokens=2 * cap, page=PAGE)):
        runner = ModelRunner(model, graphs=True)
        sched = Scheduler(strategy(name, model), model,
                          replace(GREEDY, max_num_batched_tokens=16),
                          2 if paging is None else 4, cap, runner=runner, paging=paging)
        outs.append([r.out for r in run_rows(sched, ps, checked=paging is not None)])
        assert runner.captures == len(runner._graphs) > 0  # each shape captured once
    assert outs[0] == outs[1]
    assert_all_free(sched)


def test_sizes_read_with_their_units():
    assert [parse_size(s) for s in ("2GiB", "1.5GB", "300000000", "512 MiB")] == [
        2 * 2 ** 30, 1_500_000_000, 300_000_000, 512 * 2 ** 20]
    # a bare fraction or exponent is no number of bytes; nan, inf and 1e400 no size at all
    for bad in ("", "2XB", "-1GB", "GiB", "0.5", "1e3", "nanGB", "infGB", "1e400GB"):
        assert parse_size(bad) is None, bad
