"""Greedy generation: `ar` against transformers `generate`, batched against unbatched, and
`static` self-speculation against `ar`, token for token (the lossless invariant)."""

from __future__ import annotations

import random

import pytest
import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.model.tokenizer import encode
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.options import format_skip
from knapspec_dist.speculation.selfspec import SelfSpeculative, StaticSelector

from batching import with_eos
from conftest import CONFIG_NAMES, random_prompt

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
    return generate(Autoregressive(), model, prompts, GenerationConfig(max_new_tokens=n, **kw))


def static(model, prompt, skip, gamma, tau, n, **kw):
    strategy = SelfSpeculative(StaticSelector(frozenset(skip), gamma), tau_conf=tau)
    return generate(strategy, model, [prompt], GenerationConfig(max_new_tokens=n, **kw))[0]


def tiny_prompts(vocab: int) -> list[list[int]]:
    # 240 + new tokens runs past the llama3 config's original_max_position_embeddings (256).
    return [random_prompt(n, vocab, seed=100 + n) for n in (5, 19, 240)]


# --------------------------------------------------------------------------- ar vs transformers

NEW = 64


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_ar_greedy_equals_transformers_generate(name, engine_model, hf_reference):
    model, ref = engine_model(name), hf_reference(name)
    prompts = tiny_prompts(model.cfg.vocab_size)
    if "llama3rope" not in name:  # the 240-token prompt matters where rope scaling does
        prompts = prompts[:2]
    for prompt in prompts:
        got = ar(model, [prompt], NEW, **NO_EOS)[0]
        assert got.finish_reason == "length"
        assert got.token_ids == hf_greedy(ref, prompt, NEW), (name, len(prompt))


@pytest.mark.e2e
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
    single = [ar(m, [p], 40)[0] for p in prompts]
    batched = ar(m, prompts, 40)
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    assert [r.finish_reason for r in batched] == [r.finish_reason for r in single]
    assert batched[0].finish_reason == "eos" and batched[0].token_ids[-1] == eos
    assert len(batched[0].token_ids) < 40


@pytest.mark.e2e
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
        {2 * layer for layer in range(num_layers)},  # every attention (50%)
        {2 * layer + 1 for layer in range(num_layers)},  # every MLP (50%)
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
        assert s.new_tokens == 1 + s.accepted + s.rounds


# The random test models are flat (the top-1 probability rarely exceeds 0.3), so at the
# default tau_conf=0.7 their drafts nearly always exit at once; tau_conf=0.25 exercises drafts
# cut short mid-way, and tau_conf=0 drafts the full gamma every round. SmolLM2 below is
# confident enough for tau_conf=0.7 to draft.
@pytest.mark.parametrize("tau", [0.0, 0.25, 0.7])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_static_equals_ar(name, tau, engine_model):
    model = engine_model(name)
    prompts = tiny_prompts(model.cfg.vocab_size)
    new = 24
    reference = [ar(model, [p], new, **NO_EOS)[0].token_ids for p in prompts]
    drafted = rejected = full_drafts = 0
    gammas = set()
    sets = list(enumerate(skip_sets(model.cfg.num_layers)))
    if 0 < tau < 0.5:
        sets = sets[::2]
    for k, skip in sets:
        gamma = 1 + k % 10 if tau else 10 - k % 10
        gammas.add(gamma)
        j = k % 3
        r = static(model, prompts[j], skip, gamma, tau, new, **NO_EOS)
        assert r.token_ids == reference[j], (format_skip(frozenset(skip)), gamma, j)
        assert r.finish_reason == "length"
        check_stats(r, limit_reached=True)
        drafted += r.stats.drafted
        rejected += r.stats.drafted - r.stats.accepted
        full_drafts += r.stats.rounds * gamma
        if not skip and tau == 0:  # drafting with the full model: everything accepted
            assert r.stats.acceptance_rate == 1.0
    if tau == 0 or tau >= 0.5:
        assert gammas == set(range(1, 11)) and len(sets) >= 10
    # The comparison is not vacuous: drafts were made and some were rejected (rollbacks).
    if tau == 0:
        assert drafted > 100 and rejected > 10
    elif tau < 0.5:  # confidence exit cut drafts short, yet drafts happened
        assert 5 < drafted < full_drafts / 2 and rejected > 0

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


SMOL_NEW = 20


def smol_plans() -> list[tuple[set[int], int, float]]:
    """(skip, gamma, tau_conf) on SmolLM2's 30 layers: 11 skip sets, gamma 1..10, two taus.

    Its drafts are rarely confident (top-1 probability > 0.7), so the tau_conf=0.7 plans use
    mild skip sets (sublayers whose removal keeps ~90% top-1 agreement); the heavy ones run at
    tau_conf=0 with short drafts, since nearly every draft they make is rejected."""
    a = lambda *layers: {2 * layer for layer in layers}  # noqa: E731
    m = lambda *layers: {2 * layer + 1 for layer in layers}  # noqa: E731
    mild = sorted(a(4, 5, 6, 7, 9, 17, 22, 23, 25, 26, 28, 29) | m(12, 13, 23, 25))
    return [
        (a(4, 5, 6, 7, 22, 23, 25), 4, 0.7),  # attention only
        (m(23, 25), 6, 0.7),  # MLP only
        (a(17, 29) | m(23), 8, 0.7),  # mixed
        (a(29), 10, 0.7),  # the last layer's attention
        (a(*range(30)), 2, 0.7),  # every attention (50%)
        (a(0, 29) | m(0, 29), 1, 0.0),  # first and last layer
        (a(*range(4, 24)) | m(*range(8, 20)), 2, 0.0),  # 53% of the sublayers, mixed
        (a(*range(4, 30)) - a(10, 11, 21, 24), 3, 0.0),  # attention only, 22 of 30
        (a(7, 25) | m(23), 9, 0.0),  # mixed, mild
        (set(random.Random(7).sample(mild, 8)), 5, 0.0),  # random mild
        (set(), 7, 0.0),  # the full model as its own draft
    ]


@pytest.fixture(scope="module")
def smol_prompts(smollm2, corpus_prompt):
    tok = smollm2.tokenizer
    return [encode(tok, "Write a short poem about the sea and the wind.", chat=True),
            encode(tok, "Summarize in one sentence:\n\n" + tok.decode(corpus_prompt[200:420]),
                   chat=True),
            corpus_prompt[:150]]


@pytest.mark.e2e
def test_static_equals_ar_smollm2(smollm2, smol_prompts):
    model = smollm2.model
    reference = [ar(model, [p], SMOL_NEW, **NO_EOS)[0].token_ids for p in smol_prompts]
    plans = smol_plans()
    assert len({frozenset(s) for s, _, _ in plans}) >= 10
    assert {g for _, g, _ in plans} == set(range(1, 11))
    drafted = rejected = 0
    drafted_at, accepted_at, full_at = ({0.7: 0, 0.0: 0} for _ in range(3))
    for k, (skip, gamma, tau) in enumerate(plans):
        j = k % len(smol_prompts)
        r = static(model, smol_prompts[j], skip, gamma, tau, SMOL_NEW, **NO_EOS)
        assert r.token_ids == reference[j], (format_skip(frozenset(skip)), gamma, tau, j)
        check_stats(r, limit_reached=True)
        drafted += r.stats.drafted
        rejected += r.stats.drafted - r.stats.accepted
        drafted_at[tau] += r.stats.drafted
        accepted_at[tau] += r.stats.accepted
        full_at[tau] += r.stats.rounds * gamma
        if not skip:
            assert r.stats.acceptance_rate >= 0.9
    # Not vacuous: drafts were made, accepted and rejected, at both confidence thresholds.
    assert drafted > 50 and rejected > 20 and min(accepted_at.values()) > 0
    assert drafted_at[0.7] < full_at[0.7] / 2  # the confidence exit did cut drafts short
