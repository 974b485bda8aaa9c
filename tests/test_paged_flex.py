"""Attention over pages on the flex backend (model/block_mask.py's ``paged_block_mask``): the
mask reads exactly each row's visible keys in the pool, flex over the pool gives the
attention of the rows' own keys, and the model on pages gives fixed slots' tokens, eagerly and
under CUDA's capture semantics (engine/capture.py), with rows coming and going between rounds.
On the CPU flex runs through dynamo's counting backend with eager kernels (``flex_compiles``);
the GPU runs the same program with inductor's kernels (``knapspec gpu-check``'s paged section).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from knapspec_dist.engine.capture import EmulatedGraph
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.pages import Paging
from knapspec_dist.engine.sampling import SamplingConfig
from knapspec_dist.engine.scheduler import Scheduler
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.model.block_mask import SKIP_Q_BLOCKS, paged_block_mask
from knapspec_dist.model.paged_cache import SCRATCH, PagedKVCache
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.speculation.options import StrategyOptions
from knapspec_dist.speculation.selfspec import SelfSpeculative

from batching import check_pool, mixed_prompts, run_rows
from copies import PerToken, ragged_copies, ragged_rounds
from synthetic import LINEAR_ATTENTION, synthetic_profile

NAME = "llama-gqa"
PAGE = 16
#: Mixed lengths, three past the 32-token prefill budget (chunked), the longest row half the
#: paged pool (rows wait for pages); short, as flex on the CPU runs its math over the whole pool
#: for every query.
LENGTHS = (9, 40, 23, 70, 4, 33)
pytestmark = pytest.mark.skipif(not SKIP_Q_BLOCKS, reason="paged flex needs torch 2.11+")


def scattered(rows: int, blocks: int, n_pages: int, seed: int) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """A block table of ``rows`` rows holding ``blocks`` pages each, in a shuffled order of
    the pool's pages (never the scratch page), and its inverse (page -> logical block)."""
    order = list(range(1, n_pages))
    random.Random(seed).shuffle(order)
    table = torch.tensor(order[:rows * blocks]).view(rows, blocks)
    logical = torch.zeros(n_pages, dtype=torch.int64)
    for row in table:
        logical[row] = torch.arange(blocks)
    return table, logical


def visible(mask, b: int, q: int, keys: int) -> set[int]:
    """The physical keys query ``q`` of row ``b`` reads through a BlockMask: its full blocks
    whole, its partial blocks where the mask_mod says so."""
    qb, block = q // mask.BLOCK_SIZE[0], mask.BLOCK_SIZE[1]
    out = set()
    for n, idx, full in ((mask.full_kv_num_blocks, mask.full_kv_indices, True),
                         (mask.kv_num_blocks, mask.kv_indices, False)):
        for kb in idx[b, 0, qb, :int(n[b, 0, qb])].tolist():
            for key in range(kb * block, min((kb + 1) * block, keys)):
                if full or bool(mask.mask_mod(torch.tensor(b), torch.tensor(0),
                                              torch.tensor(q), torch.tensor(key))):
                    out.add(key)
    return out


@pytest.mark.parametrize("t", [1, 5, 40])
def test_the_paged_mask_reads_each_rows_visible_keys_and_nothing_else(t):
    """Rows on shuffled pages at starts across page edges: each query reads exactly the
    physical keys of its row's logical positions 0 .. start + q, through the block lists (the
    fused kernel) and through the mask_mod alone (the unfused path)."""
    n_pages, blocks = 40, 8
    table, logical = scattered(3, blocks, n_pages, seed=t)
    starts = torch.tensor([0, 17, 127 - t])
    mask = paged_block_mask(starts, t, table, logical, PAGE)
    for b in range(3):
        for q in range(t):
            want = {int(table[b, pos // PAGE]) * PAGE + pos % PAGE
                    for pos in range(int(starts[b]) + q + 1)}
            assert visible(mask, b, q, n_pages * PAGE) == want, (b, q)
            # flex's unfused path asks the mask_mod of every key in the pool
            keys = torch.arange(n_pages * PAGE)
            everywhere = mask.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), keys)
            assert set(keys[everywhere].tolist()) == want, (b, q)


def test_flex_over_the_pool_equals_sdpa_over_each_rows_keys():
    """GQA queries of 3 rows against one pool (the keys' batch of 1 broadcast over the rows):
    the attention of each row's own keys gathered in logical order."""
    n_pages, blocks, kv, group, hd, t = 30, 6, 2, 3, 16, 5
    table, logical = scattered(3, blocks, n_pages, seed=1)
    starts = torch.tensor([3, 40, 90])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, kv * group, t, hd, generator=g)
    pool_k, pool_v = (torch.randn(1, kv, n_pages * PAGE, hd, generator=g) for _ in range(2))
    mask = paged_block_mask(starts, t, table, logical, PAGE)
    got = flex_attention(q, pool_k, pool_v, block_mask=mask, enable_gqa=True)
    length = blocks * PAGE
    index = (table[:, :, None] * PAGE + torch.arange(PAGE)).reshape(3, length)
    keys, values = (p[0][:, index].transpose(0, 1) for p in (pool_k, pool_v))  # [B, KV, L, hd]
    positions = starts[:, None] + torch.arange(t)
    allowed = torch.arange(length)[None, None, None] <= positions[:, None, :, None]
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_inverse_table_follows_assign_and_a_retire_move(engine_model):
    """``logical`` gives each held page its block in its row: set when pages are given, kept
    when a retire moves a row (pages keep their blocks), the table only ever changed in place."""
    cfg = engine_model(NAME).cfg
    cache = PagedKVCache(cfg, 2, 64, n_pages=12, page=PAGE, dtype=torch.float32, device="cpu")
    table, logical = cache.table, cache.logical
    cache.assign(0, [5, 2, 9])
    cache.assign(1, [7, 1])
    cache.release(0)
    cache.move_row(1, 0)
    assert cache.table is table and cache.logical is logical
    assert cache.table[0].tolist() == [7, 1, SCRATCH, SCRATCH]
    assert set(cache.table[1].tolist()) == {SCRATCH}
    assert (cache.logical[7], cache.logical[1]) == (0, 1)


def strategy(name: str, model):
    options = {"ar": {}, "static": {"skip": "a1,m2", "gamma": 4},
               "knapspec": {"interval": 8}}[name]
    profiles = ([synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0,
                                   verify_scale=100.0)] if name == "knapspec" else None)
    return build_strategy(StrategyOptions(name=name, tau_conf=0.0, **options), model, profiles)


GREEDY = GenerationConfig(max_new_tokens=12, stop_at_eos=False, max_num_batched_tokens=32)
SAMPLED = replace(GREEDY, sampling=SamplingConfig(temperature=0.9, seed=5))


def flex_run(model, name: str, config, ps, paging: Paging | None, seqs: int,
             runner: ModelRunner | None = None):
    cap = max(row_capacity(len(p), config.max_new_tokens) for p in ps)
    model.backend = "flex"
    try:
        sched = Scheduler(strategy(name, model), model, config, seqs, cap, runner=runner,
                          paging=paging)
        return sched, run_rows(sched, ps, checked=paging is not None)
    finally:
        model.backend = None


# `make test` keeps ar and knapspec (the batched draft/verify path); static, greedy and seeded,
# runs in `make test-e2e` and in the torch 2.11 lane, which runs this file whole.
@pytest.mark.parametrize("name,config", [
    ("ar", GREEDY), pytest.param("static", GREEDY, marks=pytest.mark.e2e),
    ("knapspec", GREEDY), pytest.param("static", SAMPLED, marks=pytest.mark.e2e)],
    ids=["ar", "static", "knapspec", "static-seeded"])
def test_paged_flex_rows_get_the_tokens_of_fixed_flex_slots(engine_model, flex_compiles, name,
                                                            config):
    """More rows than the fixed cache's slots, mixed lengths, chunked prefill, rows waiting
    for pages, padded to batch buckets: the flex backend over pages gives every row the
    tokens it gets over fixed slots, and every page comes back."""
    model = engine_model(NAME)
    ps = mixed_prompts(model.cfg.vocab_size, LENGTHS)
    cap = max(row_capacity(len(p), config.max_new_tokens) for p in ps)
    _, want = flex_run(model, name, config, ps, None, 2)
    sched, got = flex_run(model, name, config, ps, Paging(tokens=2 * cap, page=PAGE), 4)
    assert [r.out for r in got] == [r.out for r in want]
    pool = sched.batch.pool
    assert len(pool.free) == pool.total and flex_compiles.frame_count > 0
    if name != "ar":
        assert sum(r.stats.drafted for r in got) > 0, "speculation never ran"


@pytest.mark.parametrize("name", ["ar", pytest.param("static", marks=pytest.mark.e2e)])
def test_emulated_capture_over_pages_gives_eager_fixed_tokens(engine_model, flex_compiles,
                                                             name):
    """The CUDA path whole: compiled flex over pages, its forwards captured as CUDA captures
    them (nothing runs during a capture) and replayed while rows are admitted and retired
    between rounds: eager fixed slots' tokens, and no capture per admission."""
    model = engine_model(NAME)
    ps = mixed_prompts(model.cfg.vocab_size, LENGTHS)
    cap = max(row_capacity(len(p), GREEDY.max_new_tokens) for p in ps)
    _, want = flex_run(model, name, GREEDY, ps, None, 2)
    runner = ModelRunner(model, graphs=True, graph_factory=EmulatedGraph)
    paging = Paging(tokens=2 * cap, page=PAGE)
    sched, got = flex_run(model, name, GREEDY, ps, paging, 4, runner=runner)
    assert [r.out for r in got] == [r.out for r in want]
    assert runner.captures == len(runner._graphs) > 0  # each shape once
    # The job again in the other order: other rows on other pages, over the graphs already
    # captured (a shape met for the first time is the only new capture).
    sched, again = flex_run(model, name, GREEDY, ps[::-1], paging, 4, runner=runner)
    assert [r.out for r in again] == [r.out for r in want][::-1]
    assert runner.captures == len(runner._graphs), "a shape captured again for new rows"
    check_pool(sched)
    torch._dynamo.reset()


def test_ragged_verifies_under_emulated_capture_give_ars_tokens(engine_model, flex_compiles):
    """The CUDA path of copied drafts over pages: each row verifies its own copies in one
    forward of single tokens over alias rows of the cache (engine/ragged.py), compiled flex,
    captured as CUDA captures and replayed as the batch's token count changes: plain
    decoding's tokens, and a replayed ragged shape is not captured again."""
    model = engine_model(NAME)
    ps = mixed_prompts(model.cfg.vocab_size, LENGTHS)
    cap = max(row_capacity(len(p), GREEDY.max_new_tokens) for p in ps)
    paging = Paging(tokens=2 * cap, page=PAGE)
    _, want = flex_run(model, "ar", GREEDY, ps, None, 2)
    ar = [r.out for r in want]
    runner = ModelRunner(model, graphs=True, graph_factory=EmulatedGraph)
    copied = SelfSpeculative(PerToken(), tau_conf=0.0, name="copy",
                             copied=ragged_copies(ar, model.cfg.vocab_size))
    model.backend = "flex"
    try:
        sched = Scheduler(copied, model, GREEDY, 4, cap, runner=runner, paging=paging)
        got = run_rows(sched, ps, checked=True)
    finally:
        model.backend = None
    assert [r.out for r in got] == ar
    assert ragged_rounds(got) > 0
    assert runner.aliases is not None
    assert runner.captures == len(runner._graphs) > 0  # each shape once
    check_pool(sched)
    torch._dynamo.reset()
