"""Greedy generation: `ar` against transformers `generate`, batched against unbatched, and
`static` self-speculation against `ar`, token for token (the lossless invariant)."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch

from conftest import CONFIG_NAMES, random_prompt
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.selfspec import SelfSpeculative, StaticSelector
from knapspec_dist.speculation.strategy import GenerationConfig
from knapspec_dist.strategies import format_skip

NO_EOS = dict(stop_at_eos=False)


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation with EOS disabled (not min_new_tokens: that would
    suppress the EOS logit and change the argmax)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == n, "transformers stopped early: EOS was not disabled"
    return new


def ar(model, prompts, n, **kw):
    return Autoregressive().generate(model, prompts, GenerationConfig(max_new_tokens=n, **kw))


def static(model, prompt, skip, gamma, tau, n, **kw):
    strategy = SelfSpeculative(StaticSelector(frozenset(skip), gamma), tau_conf=tau)
    return strategy.generate(model, [prompt], GenerationConfig(max_new_tokens=n, **kw))[0]


def with_eos(model, token: int):
    """The same weights, with ``token`` as the model's EOS id."""
    m = copy.copy(model)
    m.cfg = replace(model.cfg, eos_token_ids=(token,))
    return m


def tiny_prompts(vocab: int) -> list[list[int]]:
    # 240 + new tokens runs past the llama3 config's original_max_position_embeddings (256).
    return [random_prompt(n, vocab, seed=100 + n) for n in (5, 19, 240)]


# --------------------------------------------------------------------------- ar vs transformers

NEW = 64


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_ar_greedy_equals_transformers_generate(name, engine_model, hf_reference):
    model, ref = engine_model(name), hf_reference(name)
    prompts = tiny_prompts(model.cfg.vocab_size)
    for prompt in prompts:
        got = ar(model, [prompt], NEW, **NO_EOS)[0]
        assert got.finish_reason == "length"
        assert got.token_ids == hf_greedy(ref, prompt, NEW), (name, len(prompt))


def test_ar_greedy_equals_transformers_generate_smollm2(smollm2, smollm2_hf, corpus_prompt):
    got = ar(smollm2.model, [corpus_prompt], NEW, **NO_EOS)[0]
    assert got.token_ids == hf_greedy(smollm2_hf, corpus_prompt, NEW)
    assert got.stats.prompt_tokens == len(corpus_prompt) and got.stats.new_tokens == NEW


# --------------------------------------------------------------------------- batched ar

@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_batched_ar_equals_unbatched(name, engine_model):
    model = engine_model(name)
    prompts = [random_prompt(n, model.cfg.vocab_size, seed=200 + n) for n in (3, 17, 64, 250)]
    single = [ar(model, [p], 40, **NO_EOS)[0].token_ids for p in prompts]
    batched = [r.token_ids for r in ar(model, prompts, 40, **NO_EOS)]
    assert batched == single
    # With an EOS that row 0 emits at step >= 5, rows finish at different steps.
    eos = next(t for t in single[0][5:] if t not in single[0][:5])
    m = with_eos(model, eos)
    single = [ar(m, [p], 40) for p in prompts]
    batched = ar(m, prompts, 40)
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert [r.finish_reason for r in batched] == [r.finish_reason for r in single]
    assert batched[0].finish_reason == "eos" and batched[0].token_ids[-1] == eos
    assert len(batched[0].token_ids) < 40


def test_batched_ar_equals_unbatched_smollm2(smollm2, corpus_prompt):
    model = smollm2.model
    prompts = [corpus_prompt[:40], corpus_prompt[100:227], corpus_prompt[300:307]]
    single = [ar(model, [p], 16, **NO_EOS)[0].token_ids for p in prompts]
    assert [r.token_ids for r in ar(model, prompts, 16, **NO_EOS)] == single


# --------------------------------------------------------------------------- static vs ar

def skip_sets(num_layers: int) -> list[set[int]]:
    """At least 10 skip sets: attention only, MLP only, mixed, >= 50%, first and last layer."""
    n, last = 2 * num_layers, num_layers - 1
    rng = random.Random(num_layers)
    sets = [
        {0},  # attention of the first layer
        {2 * last + 1},  # MLP of the last layer
        {2 * l for l in range(num_layers)},  # every attention (50%)
        {2 * l + 1 for l in range(num_layers)},  # every MLP (50%)
        {2, 2 * last + 1},  # mixed
        {0, 1, 2 * last, 2 * last + 1},  # first and last layer
        set(range(1, n)),  # all but one (> 50%)
        set(rng.sample(range(n), (n * 3 + 4) // 5)),  # random >= 60%
        {1, 2 * (num_layers // 2)},  # mixed, middle
        set(range(n)),  # everything: the draft is embedding -> lm_head
        set(),  # nothing: the draft is the full model
        {2 * (num_layers // 2) + 1, 2 * last},
    ]
    assert len({frozenset(s) for s in sets}) == len(sets) >= 10
    return sets


def check_stats(r, limit_reached: bool) -> None:
    s = r.stats
    assert s.new_tokens == len(r.token_ids)
    assert 0 <= s.accepted <= s.drafted
    assert s.acceptance_rate == (s.accepted / s.drafted if s.drafted else 0.0)
    assert s.draft_s >= 0 and s.verify_s > 0 and s.draft_s + s.verify_s <= s.wall_s
    if limit_reached:  # one token after prefill, then accepted + 1 per verify round
        assert s.new_tokens == 1 + s.accepted + s.steps


@pytest.mark.parametrize("tau", [0.7, 0.0])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_static_equals_ar(name, tau, engine_model):
    model = engine_model(name)
    prompts = tiny_prompts(model.cfg.vocab_size)
    new = 40
    reference = [ar(model, [p], new, **NO_EOS)[0].token_ids for p in prompts]
    drafted = rejected = 0
    gammas = set()
    for k, skip in enumerate(skip_sets(model.cfg.num_layers)):
        gamma = 1 + k % 10 if tau else 10 - k % 10
        gammas.add(gamma)
        for j in (k % 3, (k + 1) % 3):  # two of the three prompts per skip set
            r = static(model, prompts[j], skip, gamma, tau, new, **NO_EOS)
            assert r.token_ids == reference[j], (format_skip(frozenset(skip)), gamma, j)
            assert r.finish_reason == "length"
            check_stats(r, limit_reached=True)
            drafted += r.stats.drafted
            rejected += r.stats.drafted - r.stats.accepted
            if not skip and tau == 0:  # drafting with the full model: everything accepted
                assert r.stats.acceptance_rate == 1.0
    assert gammas == set(range(1, 11))
    # The comparison is not vacuous: drafts were made and some were rejected (rollbacks).
    assert drafted > 100 and rejected > 10


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-headdim"])
def test_static_stops_at_eos_inside_a_draft(name, engine_model):
    model = engine_model(name)
    prompt = tiny_prompts(model.cfg.vocab_size)[1]
    free = ar(model, [prompt], 40, **NO_EOS)[0].token_ids
    eos = next(t for t in free[12:] if t not in free[:12])
    m = with_eos(model, eos)
    want = ar(m, [prompt], 40)[0]
    assert want.finish_reason == "eos" and want.token_ids == free[:free.index(eos) + 1]
    for skip, gamma in (({2}, 6), ({1, 6}, 10), (set(), 8)):
        r = static(m, prompt, skip, gamma, 0.0, 40)
        assert (r.token_ids, r.finish_reason) == (want.token_ids, "eos")
        check_stats(r, limit_reached=False)


SMOL_NEW = 24


def smol_plans() -> list[tuple[set[int], int, float]]:
    """(skip, gamma, tau_conf) on SmolLM2's 30 layers: 12 skip sets, gamma 1..10, two taus."""
    a = lambda *ls: {2 * l for l in ls}  # noqa: E731
    m = lambda *ls: {2 * l + 1 for l in ls}  # noqa: E731
    rng = random.Random(7)
    return [
        (a(*range(10, 20)), 4, 0.7),  # attention only
        (m(*range(12, 18)), 6, 0.7),  # MLP only
        (a(5, 20) | m(7, 25), 8, 0.7),  # mixed
        (a(*range(5, 20)) | m(*range(5, 20)), 2, 0.7),  # 50% of the sublayers
        (a(0, 29) | m(0, 29), 10, 0.7),  # first and last layer
        (a(*range(30)), 3, 0.7),  # every attention (50%)
        (a(*range(1, 30, 2)) | m(*range(2, 30, 4)), 5, 0.0),  # mixed, 37%
        (a(15), 1, 0.0),  # one attention
        (a(*range(4, 24)) | m(*range(8, 20)), 7, 0.0),  # 53%
        (m(0, 29), 9, 0.0),  # first and last MLP
        (set(rng.sample(range(60), 12)), 5, 0.0),  # random 20%
        (set(), 4, 0.0),  # the full model as its own draft
    ]


@pytest.fixture(scope="module")
def smol_prompts(smollm2, corpus_prompt):
    from knapspec_dist.local import encode

    tok = smollm2.tokenizer
    return [corpus_prompt[:150],
            encode(tok, "Write a short poem about the sea and the wind.", chat=True),
            encode(tok, "Summarize in one sentence:\n\n" + tok.decode(corpus_prompt[200:420]),
                   chat=True)]


def test_static_equals_ar_smollm2(smollm2, smol_prompts):
    model = smollm2.model
    reference = [ar(model, [p], SMOL_NEW, **NO_EOS)[0].token_ids for p in smol_prompts]
    plans = smol_plans()
    assert len({frozenset(s) for s, _, _ in plans}) >= 10
    assert {g for _, g, _ in plans} == set(range(1, 11))
    drafted = rejected = 0
    for k, (skip, gamma, tau) in enumerate(plans):
        j = k % len(smol_prompts)
        r = static(model, smol_prompts[j], skip, gamma, tau, SMOL_NEW, **NO_EOS)
        assert r.token_ids == reference[j], (format_skip(frozenset(skip)), gamma, tau, j)
        check_stats(r, limit_reached=True)
        drafted += r.stats.drafted
        rejected += r.stats.drafted - r.stats.accepted
        if not skip:
            assert r.stats.acceptance_rate >= 0.9
    assert drafted > 50 and rejected > 5
