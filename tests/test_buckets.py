"""Static-batch flex attention: batches padded to a few buckets (engine/buckets.py), compiled
with an integer batch (model/attention.py), through continuous batching on the CPU."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from knapspec_dist.engine.buckets import bucket, buckets, pad_starts, padded_forward
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.scheduler import Scheduler, generate
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.decoder import Capture
from knapspec_dist.speculation.selfspec import SelfSpeculative, StaticSelector

from conftest import random_prompt

NAME = "llama-gqa"


def test_buckets_are_powers_of_two_capped_at_the_rows():
    assert [bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [bucket(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    assert buckets(6) == [1, 2, 4, 6] and buckets(1) == [1] and buckets(16) == [1, 2, 4, 8, 16]
    assert bucket(5, 4) == 5  # never fewer rows than the batch


def test_padded_rows_write_past_their_length_or_not_at_all():
    assert pad_starts([10, 20], [7, 0], 3, 64) == [10, 20, 7, 1]  # 0 stays no prefill
    assert pad_starts([10], [62], 3, 64) is None  # no room past row 1's length: no padding


def _filled_cache(model, lengths: list[int]) -> KVCache:
    cache = KVCache(model.cfg, len(lengths), 128, dtype=model.dtype, device="cpu")
    with torch.inference_mode():
        for b, n in enumerate(lengths):
            if n:
                model(torch.tensor([random_prompt(n, model.cfg.vocab_size, seed=b)]), [0],
                      cache, slice(b, b + 1))
            cache.commit(b, n)
    return cache


def test_padded_forward_equals_the_unpadded_one_and_keeps_the_other_rows(engine_model):
    """Three rows padded to four: the pad row is the row being prefilled (valid K/V up to its
    length), which must survive; logits and captured states equal the unpadded forward's."""
    model = engine_model(NAME)
    lengths = [9, 30, 17, 21, 0]
    caches = [_filled_cache(model, lengths) for _ in range(2)]
    tokens = torch.randint(model.cfg.vocab_size, (3, 2))
    before = [t.clone() for t in caches[1].k + caches[1].v]
    with torch.inference_mode():
        plain_states, padded_states = Capture(keep=1), Capture(keep=1)
        plain = model(tokens, lengths[:3], caches[0], slice(0, 3), capture=plain_states)
        padded = padded_forward(model, tokens, lengths[:3], caches[1], slice(0, 3),
                                padded_states)
    assert padded is not None and padded.shape == plain.shape
    torch.testing.assert_close(padded, plain, atol=1e-5, rtol=1e-5)
    assert len(padded_states) == len(plain_states) and padded_states[0].shape[0] == 3
    for a, b in zip(padded_states, plain_states):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for old, new in zip(before, caches[1].k + caches[1].v):
        assert torch.equal(new[3, :, :21], old[3, :, :21]), "the prefilling row's K/V changed"
        assert torch.equal(new[:3, :, :9], old[:3, :, :9])
    # Four rows already are a bucket; a cache of three rows has no room to pad.
    assert padded_forward(model, torch.zeros(4, 1, dtype=torch.long), lengths[:4],
                          caches[1], slice(0, 4), None) is None
    small = _filled_cache(model, lengths[:3])
    assert padded_forward(model, tokens, lengths[:3], small, slice(0, 3), None) is None


def _graph_batches(counter: CompileCounterWithBackend) -> list:
    """The query batch of every graph dynamo compiled: an int where the batch is static (a
    specialized SymInt counts: inductor's lowering then sees a sympy Integer), else None."""
    return [int(b) if is_concrete_int(b) else None
            for g in counter.graphs for n in g.graph.nodes
            if n.op == "placeholder" and n.name == "l_q_"
            for b in [n.meta["example_value"].shape[0]]]


def test_continuous_batching_compiles_one_flex_kernel_per_bucket(engine_model, monkeypatch,
                                                                 flex_compiles):
    """A continuous-batching run through batch sizes 1..4 and back on the flex backend
    (compiled by dynamo on the CPU, counted), speculative rounds (T = 1 drafts, T = 4
    verifies) replayed through the runner's graphs: every compiled graph has an integer batch
    from the buckets, at most two graphs per bucket (T = 1, T > 1), and the tokens equal
    unpadded SDPA decoding's."""
    model = engine_model(NAME)
    rows, limit = 4, 16
    seqs = [random_prompt(5 + 7 * i, model.cfg.vocab_size, seed=60 + i) for i in range(rows)]
    config = GenerationConfig(max_new_tokens=limit, stop_at_eos=False)

    def make():
        return SelfSpeculative(StaticSelector(frozenset({2, 5}), 3), tau_conf=0.0)

    want = [r.token_ids for r in generate(make(), model, seqs, config,
                                          runner=ModelRunner(model, graphs=False))]
    counter = flex_compiles
    model.backend = "flex"
    try:
        # Prompts prefilled 16 tokens per step: a row mid-prefill is often a padded row.
        sched = Scheduler(make(), model, replace(config, max_num_batched_tokens=16), rows, 128,
                          runner=ModelRunner(model, graphs=True))
        sizes, got, mid_prefill = [], {}, 0
        todo = list(enumerate(seqs))
        while todo or sched.busy:  # one row queued per step: batch 1, 2, .., 4 and back
            if todo:
                sched.add(*todo.pop(0))
            got.update((r.rid, r.out) for r in sched.step())
            sizes.append(sched.batch.size)
            mid_prefill += sched.batch.prefilling is not None and sched.batch.size > 0
    finally:
        model.backend = None
        torch._dynamo.reset()  # no counted graphs left for later tests
    assert set(range(1, rows + 1)) <= set(sizes), sizes
    assert mid_prefill, "no round ran while a row was being prefilled"
    assert [got[i] for i in range(rows)] == want
    batches = _graph_batches(counter)
    assert batches and None not in batches, batches
    assert set(batches) <= set(buckets(rows)) and len(set(batches)) > 1
    assert counter.frame_count <= 2 * len(buckets(rows)), counter.frame_count


def test_flex_compiles_once_per_query_kind_whatever_the_capacity(engine_model, flex_compiles):
    """T and the cache capacity are dynamic from the first compile: forwards of T = 1, 3 and
    5 over caches of three capacities compile two graphs (T = 1, T > 1), not a static graph
    per first value and a dynamic one after; each gives SDPA's logits."""
    model = engine_model(NAME)
    counter = flex_compiles
    try:
        with torch.inference_mode():
            for capacity in (256, 512, 1280):
                cache = KVCache(model.cfg, 2, capacity, dtype=model.dtype, device="cpu")
                for t in (1, 3, 5):
                    tokens = torch.randint(model.cfg.vocab_size, (2, t))
                    model.backend = "sdpa"
                    want = model(tokens, [40, 57], cache, slice(0, 2))
                    model.backend = "flex"
                    got = model(tokens, [40, 57], cache, slice(0, 2))
                    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        model.backend = None
        torch._dynamo.reset()
    assert counter.frame_count == 2, counter.frame_count
