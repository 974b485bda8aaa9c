"""The preallocated KV cache: O(1) rollback, no reallocation, draft writes only executed
attention layers, verification overwrites every layer."""

from __future__ import annotations

import pytest
import torch

from knapspec_dist.engine import model_runner as runner
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.model.cache import KVCache
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.selfspec import SelfSpeculative, StaticSelector

from conftest import random_prompt

NAME = "llama-gqa"  # 4 layers, GQA
SENTINEL = 7.25


def new_cache(model, capacity=64, batch=1) -> KVCache:
    return KVCache(model.cfg, batch, capacity, dtype=model.dtype, device=model.device)


def run(model, cache, tokens, skip=frozenset(), commit=True):
    with torch.inference_mode():
        logits = model(torch.tensor([tokens]), cache.lengths[slice(0, 1)],
                       cache, skip=frozenset(skip))[0]
    if commit:
        cache.commit(0, cache.lengths[0] + len(tokens))
    return logits


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> None:
    """Equal up to fp32 rounding (a stale draft entry would be off by O(1))."""
    diff = (a - b).abs().max().item()
    assert diff <= tol, diff


def pointers(cache) -> list[int]:
    return [t.data_ptr() for t in cache.k + cache.v]


def test_commit_moves_the_length_only(engine_model):
    model = engine_model(NAME)
    tokens = random_prompt(12, model.cfg.vocab_size, seed=1)
    cache = new_cache(model)
    run(model, cache, tokens)
    before = [t.clone() for t in cache.k + cache.v]
    ptrs = pointers(cache)
    cache.commit(0, 5)  # roll back 7 positions
    assert cache.lengths == [5]
    assert pointers(cache) == ptrs
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v))  # nothing copied
    # Decoding on from the rolled-back length ignores the stale entries beyond it.
    nxt = random_prompt(3, model.cfg.vocab_size, seed=2)
    got = run(model, cache, nxt)
    want = run(model, new_cache(model), tokens[:5] + nxt)[5:]
    assert (got - want).abs().max() <= 1e-5
    with pytest.raises(ValueError):
        cache.commit(0, cache.capacity + 1)
    with pytest.raises(ValueError):
        cache.commit(0, -1)


def test_capacity_exceeded_is_an_error(engine_model):
    model = engine_model(NAME)
    cache = new_cache(model, capacity=8)
    with pytest.raises(ValueError, match="capacity"):
        run(model, cache, random_prompt(9, model.cfg.vocab_size, seed=3))


def test_draft_writes_only_executed_attention_and_verify_overwrites(engine_model):
    model = engine_model(NAME)
    vocab = model.cfg.vocab_size
    prompt = random_prompt(10, vocab, seed=4)
    pending, draft2 = random_prompt(2, vocab, seed=5)
    cache = new_cache(model)
    run(model, cache, prompt)
    pos = len(prompt)
    for t in cache.k + cache.v:  # mark the positions the draft may write
        t[:, :, pos:pos + 2] = SENTINEL
    committed = [t[:, :, :pos].clone() for t in cache.k + cache.v]

    skip = {2, 6, 1}  # attention of layers 1 and 3, MLP of layer 0
    run(model, cache, [pending], skip=skip, commit=False)  # draft step 1 at pos
    assert cache.lengths[0] == pos  # nothing committed while drafting
    with torch.inference_mode():  # draft step 2 at pos+1
        model(torch.tensor([[draft2]]), [pos + 1], cache, skip=frozenset(skip))
    for layer in range(model.cfg.num_layers):
        for t in (cache.k[layer], cache.v[layer]):
            slots = t[:, :, pos:pos + 2]
            if 2 * layer in skip:
                assert (slots == SENTINEL).all(), f"skipped attention {layer} was written"
            else:
                assert not (slots == SENTINEL).any(), f"executed attention {layer} not written"
    assert all(torch.equal(a, t[:, :, :pos]) for a, t in zip(committed, cache.k + cache.v))

    # Layer 0 sees the same input in draft and full model, so its draft K/V are already right.
    reference = new_cache(model)
    full_logits = run(model, reference, prompt + [pending, draft2])
    assert_close(cache.k[0][:, :, pos:pos + 2], reference.k[0][:, :, pos:pos + 2])

    # Verification (full model) overwrites every layer at the drafted positions.
    verify = run(model, cache, [pending, draft2])
    n = pos + 2
    for layer in range(model.cfg.num_layers):
        assert_close(cache.k[layer][:, :, :n], reference.k[layer][:, :, :n])
        assert_close(cache.v[layer][:, :, :n], reference.v[layer][:, :, :n])
    assert (verify - full_logits[pos:]).abs().max() <= 1e-4


class RecordingCache(KVCache):
    """A KVCache that remembers its storage pointers and every commit."""

    made: list["RecordingCache"] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ptrs = pointers(self)
        self.shapes = [t.shape for t in self.k + self.v]
        self.commits: list[tuple[int, int, int]] = []  # (row, new length, furthest written)
        self.written = [0] * self.batch
        self.moved = False
        RecordingCache.made.append(self)

    def write(self, layer, meta, k, v):
        if pointers(self) != self.ptrs:
            self.moved = True
        rows = range(*meta.rows.indices(self.batch))
        for b, row in enumerate(rows):
            self.written[row] = max(self.written[row], int(meta.positions[b].max()) + 1)
        return super().write(layer, meta, k, v)

    def commit(self, row, length):
        self.commits.append((row, length, self.written[row]))
        super().commit(row, length)


@pytest.fixture
def recording(monkeypatch):
    RecordingCache.made = []
    monkeypatch.setattr(runner, "KVCache", RecordingCache)  # strategies' caches come from it
    return RecordingCache.made


def test_generation_never_reallocates_and_rolls_back(engine_model, recording):
    model = engine_model(NAME)
    prompt = random_prompt(20, model.cfg.vocab_size, seed=6)
    config = GenerationConfig(max_new_tokens=48, stop_at_eos=False)
    spec = SelfSpeculative(StaticSelector(frozenset({2, 5, 6}), 6), tau_conf=0.0)
    r = generate(spec, model, [prompt], config)[0]
    a = generate(Autoregressive(), model, [prompt], config)[0]
    assert r.token_ids == a.token_ids
    spec_cache, ar_cache = recording
    for c in (spec_cache, ar_cache):
        assert not c.moved and pointers(c) == c.ptrs
        assert [t.shape for t in c.k + c.v] == c.shapes
    # Rejected drafts were rolled back by committing a length short of what was written.
    rollbacks = [(n, w) for _, n, w in spec_cache.commits if n < w]
    assert r.stats.accepted < r.stats.drafted and rollbacks
    # After generation both caches hold the same K/V for every valid position of every
    # layer: verification overwrote whatever the drafts left behind.
    n = len(prompt) + len(r.token_ids) - 1  # the row's final length (its slot is then freed)
    assert max(c for _, c, _ in spec_cache.commits) == n
    assert max(c for _, c, _ in ar_cache.commits) == n
    for layer in range(model.cfg.num_layers):
        assert_close(spec_cache.k[layer][:, :, :n], ar_cache.k[layer][:, :, :n])
        assert_close(spec_cache.v[layer][:, :, :n], ar_cache.v[layer][:, :, :n])


def test_batched_ar_never_reallocates(engine_model, recording):
    model = engine_model(NAME)
    prompts = [random_prompt(n, model.cfg.vocab_size, seed=n) for n in (4, 30)]
    generate(Autoregressive(), model, prompts, GenerationConfig(max_new_tokens=20,
                                                               stop_at_eos=False))
    (cache,) = recording
    assert not cache.moved and pointers(cache) == cache.ptrs
    # Both rows reached their final length (the first to finish leaves; the other moves up).
    assert {4 + 19, 30 + 19} <= {n for _, n, _ in cache.commits}
