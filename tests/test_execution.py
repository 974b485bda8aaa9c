"""The GPU execution path, exercised on the CPU: static-shape forwards (device ``starts``, all
``capacity`` keys, lengths read on the device) replayed through the model runner's graph
stand-in, the sync-free draft loop, and flex_attention's length block mask. The same code runs
under CUDA graphs on a GPU (tests/test_gpu.py, ``knapspec gpu-check``)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.sampling import SamplingConfig
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.model.attention import FLEX_BLOCK
from knapspec_dist.model.block_mask import length_block_mask
from knapspec_dist.model.cache import KVCache
from knapspec_dist.profiles.profiler import measure
from knapspec_dist.profiles.replay import ReplayTimer
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.selfspec import SelfSpeculative, StaticSelector
from knapspec_dist.tools.gpucheck.late import block_mask_ops

from conftest import random_prompt

NAME = "llama-gqa"
GREEDY = GenerationConfig(max_new_tokens=24, stop_at_eos=False)


def prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(n, vocab, seed=40 + n) for n in (7, 33, 90)]


def test_static_shape_forward_equals_eager(engine_model):
    """Rows at different lengths, T = 1 and T = 3, keys read up to the capacity with the lengths
    on the device: the logits equal the eager forward's (host hints, sliced keys)."""
    model = engine_model(NAME)
    seqs = prompts(model.cfg.vocab_size)
    caches = [KVCache(model.cfg, 3, 160, dtype=model.dtype, device="cpu") for _ in range(2)]
    gen = torch.Generator().manual_seed(0)  # the same tokens whatever ran before
    with torch.inference_mode():
        for cache in caches:
            for b, s in enumerate(seqs):
                model(torch.tensor([s]), [0], cache, slice(b, b + 1))
                cache.commit(b, len(s))
        for t in (1, 3):
            tokens = torch.randint(model.cfg.vocab_size, (3, t), generator=gen)
            eager = model(tokens, caches[0].lengths, caches[0])
            static = model(tokens, torch.tensor(caches[1].lengths), caches[1])
            # the same sums in another order (masked capacity vs sliced keys): fp32 rounding,
            # scaled by the logits' size (unseeded tokens once differed by 1.5e-5 at rtol 1e-5)
            torch.testing.assert_close(static, eager, rtol=1e-5,
                                       atol=1e-5 * max(1.0, float(eager.abs().max())))


@pytest.mark.parametrize("strategy", ["ar", "static", "static-pieces"])
def test_graph_replay_gives_the_tokens_of_eager_decoding(engine_model, strategy):
    """Decode, verify and draft forwards replayed from graphs (per plan, or per sublayer
    pieces) give eager decoding's tokens."""
    model = engine_model(NAME)
    seqs = prompts(model.cfg.vocab_size)

    def make():
        if strategy == "ar":
            return Autoregressive()
        return SelfSpeculative(StaticSelector(frozenset({2, 5, 7}), 3), tau_conf=0.3)

    eager = generate(make(), model, seqs, GREEDY, runner=ModelRunner(model, graphs=False))
    graphed = make()
    runner = ModelRunner(model, graphs=True)
    if strategy == "static-pieces":
        runner.draft_graphs = "pieces"
    replayed = generate(graphed, model, seqs, GREEDY, runner=runner)
    assert [r.token_ids for r in replayed] == [r.token_ids for r in eager]
    assert runner.captures > 0  # the graph path really ran
    # A second request reuses the cache and its graphs.
    before = runner.captures
    again = generate(graphed, model, seqs, GREEDY, runner=runner)
    assert [r.token_ids for r in again] == [r.token_ids for r in eager]
    if strategy != "ar":
        assert runner.captures == before
    if strategy == "static-pieces":
        assert runner._piece_sets and sum(r.stats.drafted for r in replayed) > 0


def test_cache_is_reused_while_it_fits(engine_model):
    model = engine_model(NAME)
    runner = ModelRunner(model, graphs=False)
    a = runner.new_cache(1, 100, model.cfg.num_kv_heads)
    a.commit(0, 50)
    b = runner.new_cache(1, 200, model.cfg.num_kv_heads)
    assert b is a and b.lengths == [0] and b.capacity == 256
    c = runner.new_cache(1, 300, model.cfg.num_kv_heads)
    assert c is not a and c.capacity == 512


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, seed=3)],
                         ids=["greedy", "sampling"])
def test_drafting_without_early_exit_gives_the_same_tokens(engine_model, sampling):
    """Drafting all gamma with no read-back (``runner.early_exit = False``) emits what early
    exit emits, and what plain decoding emits with the same seeds; and acceptance is not cut at
    a row's first unsure draft: with every draft unsure (tau_conf 1), early exit drafts one
    token a round, and the full gamma keeps more, since later drafts that match count."""
    model = engine_model(NAME)
    seqs = prompts(model.cfg.vocab_size)[:2]
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False, sampling=sampling)
    want = [r.token_ids for r in generate(Autoregressive(), model, seqs, config)]
    for skip, tau in ((frozenset({2, 5}), 0.6), (frozenset({7}), 1.0)):
        runs = {}
        for early in (True, False):
            runner = ModelRunner(model, graphs=False)
            runner.early_exit = early
            s = SelfSpeculative(StaticSelector(skip, 4), tau_conf=tau)
            runs[early] = generate(s, model, seqs, config, runner=runner)
            assert [r.token_ids for r in runs[early]] == want
        if tau == 1.0:
            accepted = {e: sum(r.stats.accepted for r in runs[e]) for e in runs}
            assert all(r.stats.drafted <= r.stats.rounds for r in runs[True])
            assert accepted[False] > accepted[True], \
                "without early exit acceptance stopped at the first unsure draft"


def _dense_visible(starts: list[int], t: int, kv_len: int) -> torch.Tensor:
    keys = torch.arange(kv_len)
    pos = torch.tensor(starts)[:, None] + torch.arange(t)[None]
    return keys[None, None, :] <= pos[:, :, None]  # [B, T, S]


@pytest.mark.parametrize("starts,t", [([0, 5, 127], 1), ([126, 300, 40], 3), ([1, 250], 140)])
def test_length_block_mask_covers_exactly_the_visible_keys(starts, t):
    """Blocks marked full are wholly visible, partial blocks hold every visible key the full
    ones miss, and no key past a row's length is in any block."""
    kv_len = 512
    mask = length_block_mask(torch.tensor(starts), t, kv_len)
    visible = _dense_visible(starts, t, kv_len)
    full_n, full_i = mask.full_kv_num_blocks, mask.full_kv_indices
    part_n, part_i = mask.kv_num_blocks, mask.kv_indices
    for b in range(len(starts)):
        for qb in range(-(-t // FLEX_BLOCK)):
            rows = visible[b, qb * FLEX_BLOCK:(qb + 1) * FLEX_BLOCK]
            covered = torch.zeros(kv_len, dtype=torch.bool)
            for kb in full_i[b, 0, qb, :full_n[b, 0, qb]].tolist():
                block = rows[:, kb * FLEX_BLOCK:(kb + 1) * FLEX_BLOCK]
                assert block.all(), f"row {b} q-block {qb}: block {kb} is not wholly visible"
                covered[kb * FLEX_BLOCK:(kb + 1) * FLEX_BLOCK] = True
            for kb in part_i[b, 0, qb, :part_n[b, 0, qb]].tolist():
                assert not covered[kb * FLEX_BLOCK], f"block {kb} both full and partial"
                covered[kb * FLEX_BLOCK:(kb + 1) * FLEX_BLOCK] = True
            needed = rows.any(dim=0)
            assert covered[needed].all(), f"row {b} q-block {qb}: a visible key is skipped"
            last = int(needed.nonzero().max())
            assert not covered[(last // FLEX_BLOCK + 1) * FLEX_BLOCK:].any(), "reads past length"


def test_block_mask_skips_the_backward_indices_where_torch_can():
    """Where torch takes ``compute_q_blocks`` the mask has no q indices and fewer ops (about
    92 -> 32 on torch 2.13); elsewhere both counts are the same build."""
    supported = "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    counts = block_mask_ops("cpu", batch=3, t=2, kv_len=512)
    assert counts["compute_q_blocks_supported"] is supported
    mask = length_block_mask(torch.tensor([4, 200, 300]), 2, 512)
    if supported:
        assert counts["without_q_blocks"] < counts["with_q_blocks"] / 2
        assert mask.q_indices is None and mask.full_q_indices is None
    else:
        assert counts["without_q_blocks"] == counts["with_q_blocks"] > 0
    assert length_block_mask(torch.tensor([4]), 2, 512, q_blocks=True).q_indices is not None


@pytest.mark.e2e
@pytest.mark.slow
def test_flex_backend_matches_sdpa_on_cpu(engine_model):
    """The CUDA backend's program (compiled flex_attention with the length block mask, all
    capacity keys) on the CPU: same logits as the SDPA backend, rows at different lengths."""
    model = engine_model(NAME)
    seqs = prompts(model.cfg.vocab_size)
    out = {}
    for backend in ("sdpa", "flex"):
        model.backend = backend
        try:
            cache = KVCache(model.cfg, 3, 256, dtype=model.dtype, device="cpu")
            with torch.inference_mode():
                for b, s in enumerate(seqs):
                    model(torch.tensor([s]), [0], cache, slice(b, b + 1))
                    cache.commit(b, len(s))
                tokens = torch.tensor([[1, 2, 3]] * 3)
                out[backend] = model(tokens, cache.lengths, cache)
        finally:
            model.backend = None
    torch.testing.assert_close(out["flex"], out["sdpa"], atol=1e-4, rtol=1e-4)


def test_replay_timer_recovers_sublayer_costs_by_difference(engine_model, monkeypatch):
    """Graph-mode pricing: with replayed forwards costing head + attention per executed
    attention + mlp per executed MLP, the split returns exactly those costs."""
    model = engine_model(NAME)
    layers = model.cfg.num_layers
    cost = {"head": 3e-4, "mlp": 2e-4}

    def fake_time(self, n, q, skip=frozenset()):
        attn = 1e-4 + 1e-7 * n
        run_attn = sum(1 for i in range(0, 2 * layers, 2) if i not in skip)
        run_mlp = sum(1 for i in range(1, 2 * layers, 2) if i not in skip)
        return cost["head"] + run_attn * attn + run_mlp * cost["mlp"]

    monkeypatch.setattr(ReplayTimer, "time", fake_time)
    cache = KVCache(model.cfg, 1, 64, dtype=model.dtype, device="cpu")
    timer = ReplayTimer(model, cache, slice(0, 1), lambda q: torch.zeros(1, q, dtype=torch.long))
    split = timer.split(1000)
    assert split["attention"] == pytest.approx(1e-4 + 1e-4)
    assert split["mlp"] == pytest.approx(cost["mlp"])
    assert split["head"] == pytest.approx(cost["head"])


def test_graph_mode_profile_runs_on_the_cpu(engine_model):
    """The profiler's graph mode end to end (the graph stand-in re-runs the forwards)."""
    model = engine_model(NAME)
    profile = measure(model, [32, 64], batch=1, max_q=3, repeats=1, mode="graph")
    assert all(math.isfinite(profile.verify_time(q, n)) for q in (1, 3) for n in (32, 64))


@pytest.mark.parametrize("mode", ["plan", "pieces"])
def test_graph_draft_step_equals_the_eager_skipped_forward(engine_model, mode):
    """A draft step replayed from graphs (one per plan, or per-sublayer pieces) computes the
    logits of the eager forward with the same skip set, for two different skip sets in turn."""
    model = engine_model(NAME)
    seqs = prompts(model.cfg.vocab_size)
    runner = ModelRunner(model, graphs=True)
    runner.draft_graphs = mode
    cache = runner.new_cache(3, 200, model.cfg.num_kv_heads)
    eager_cache = KVCache(model.cfg, 3, cache.capacity, dtype=model.dtype, device="cpu")
    with torch.inference_mode():
        for c in (cache, eager_cache):
            for b, s in enumerate(seqs):
                model(torch.tensor([s]), [0], c, slice(b, b + 1))
                c.commit(b, len(s))
        tok = torch.tensor([[5], [6], [7]])
        for skip in (frozenset({2, 5, 7}), frozenset({0, 3}), frozenset({2, 5, 7})):
            got = runner(tok, cache.lengths, cache, slice(0, 3), skip)
            want = model(tok, eager_cache.lengths, eager_cache, slice(0, 3), skip)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert runner.captures > 0
