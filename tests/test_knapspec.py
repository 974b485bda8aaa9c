"""KnapSpec strategy: lossless against `ar`, across re-selections, and context-aware selection."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.engine.sequence import Batch, Row
from knapspec_dist.model.attention import prefix_attention, reference_prefix_attention
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.decoder import Capture
from knapspec_dist.speculation import knapspec, tpt
from knapspec_dist.speculation.acceptance import fit_acceptance, smoothed_alpha
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.clasp import ClaspSelector
from knapspec_dist.speculation.guard import PlanRun
from knapspec_dist.speculation.hidden_states import HiddenStateEvaluator, Reference
from knapspec_dist.speculation.knapsack import Candidate
from knapspec_dist.speculation.knapspec import (
    KnapSpecConfig,
    KnapSpecSelector,
    Selection,
    choose_by_tpt,
)
from knapspec_dist.speculation.schedule import SpareRule
from knapspec_dist.speculation.selfspec import Plan, SelfSpeculative

from synthetic import LINEAR_ATTENTION, synthetic_profile


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-headdim", "llama-tied-llama3rope"])
@pytest.mark.parametrize("variant", ["default", "coupled", "alpha", "once", "clasp"])
def test_knapspec_greedy_equals_ar_on_test_models(engine_model, name, variant):
    model = engine_model(name)
    # A full forward priced far above the sum of its sublayers makes any draft pay, so the
    # draft/verify path is exercised even with a random model's low acceptance.
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=100.0)
    # (no interval stretch: the DP's wall time on a loaded machine would decide the count)
    every = dict(interval=8, overhead_budget=1e9)
    selector = {
        "default": lambda: KnapSpecSelector(profile, KnapSpecConfig(**every)),
        "coupled": lambda: KnapSpecSelector(profile, KnapSpecConfig(**every, coupled=True)),
        "alpha": lambda: KnapSpecSelector(profile, KnapSpecConfig(**every, objective="alpha")),
        "once": lambda: KnapSpecSelector(profile, KnapSpecConfig(select_once=True)),
        "clasp": lambda: ClaspSelector(profile, gamma=3, skip_layers=0.25,
                                       config=KnapSpecConfig(interval=8))}[variant]()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (3, 40, 200)]
    config_gen = GenerationConfig(max_new_tokens=48, stop_at_eos=False)
    expected = generate(Autoregressive(), model, prompts, config_gen)
    results = generate(SelfSpeculative(selector, tau_conf=0.0, name="knapspec"), model, prompts,
                                                                                 config_gen)
    for got, want in zip(results, expected):
        assert got.token_ids == want.token_ids
        assert got.stats.selections >= (1 if variant == "once" else 2)
    assert sum(r.stats.drafted for r in results) > 0, "speculation never ran"
    if variant == "clasp":  # the baseline has no guard: it drafts whatever it yields
        assert selector.fallbacks == 0


@pytest.mark.e2e
def test_knapspec_greedy_equals_ar_on_smollm2(smollm2, corpus_prompt):
    model = smollm2.model
    # A full forward priced far above its sublayers: drafting pays clearly, so the test does
    # not hang on a borderline choice (thread scheduling changes the last float bits).
    profile = synthetic_profile(model, [(256, 8.7e-4), (8192, 7.4e-3)], mlp=7.5e-4,
                                verify_growth=0.0, verify_scale=100.0)
    prompts = [corpus_prompt[:300], corpus_prompt]
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    expected = generate(Autoregressive(), model, prompts, config)
    selector = KnapSpecSelector(profile, KnapSpecConfig(interval=8, overhead_budget=1e9))
    results = generate(SelfSpeculative(selector, name="knapspec"), model, prompts, config)
    for got, want in zip(results, expected):
        assert got.token_ids == want.token_ids
        assert got.stats.selections >= 1
    assert selector.selections >= 2  # after m tokens, then again (every 8 tokens per row)
    assert sum(r.stats.drafted for r in results) > 0


@pytest.mark.e2e
def test_reselection_skips_more_attention_as_context_grows(smollm2, corpus_prompt, monkeypatch):
    """Attention nearly free at the first selection (m tokens after the prompt), ten times an
    MLP 130 tokens later: the first selection skips MLPs, later ones skip attention."""
    # A DP's wall time decides whether later ones are spared (schedule.worth_a_dp): on a busy
    # machine fewer ran and the test failed. Priced as free here, every due DP runs; no noise
    # margin (noise_z=0): the first selection has m positions only, and this is about which
    # sublayers are skipped, not whether.
    monkeypatch.setattr(knapspec, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    model = smollm2.model
    prompt = corpus_prompt[:200]
    first_n = 200 + KnapSpecConfig().m  # the first selection waits for m generated tokens
    # (steps priced slow next to a DP on this CPU, so that each due DP is worth its cost)
    profile = synthetic_profile(model, [(first_n, 1e-4), (first_n + 130, 1.3e-1)], mlp=1e-2,
                                verify_growth=0.0)
    selector = KnapSpecSelector(profile, KnapSpecConfig(interval=40, overhead_budget=1e9,
                                                        min_gain=1.0, noise_z=0.0))
    result = generate(SelfSpeculative(selector, name="knapspec"),
        model, [prompt], GenerationConfig(max_new_tokens=170, stop_at_eos=False))[0]
    first, last = selector.history[0], selector.history[-1]
    assert first.context == first_n and last.context > first_n + 120
    attention = lambda sel: sum(1 for i in sel.plan.skip if i % 2 == 0)  # noqa: E731
    mlp = lambda sel: sum(1 for i in sel.plan.skip if i % 2 == 1)  # noqa: E731
    assert first.weights[:2] == [1, 5] and last.weights[:2] == [5, 1]
    assert mlp(first) > attention(first)
    assert attention(last) > mlp(last)
    assert result.stats.selections == len(selector.history) >= 4


def test_interval_stretches_when_selection_is_expensive(engine_model):
    model = engine_model("llama-gqa")
    profile = synthetic_profile(model, LINEAR_ATTENTION)
    selector = KnapSpecSelector(profile, KnapSpecConfig(interval=64, overhead_budget=0.05))
    step = profile.verify_time(1, 1000)
    assert selector.schedule.interval(select_s=0.0, step_s=step) == 64
    assert selector.schedule.interval(select_s=step * 10, step_s=step) == 200  # 10 steps / 5 %


def test_smoothed_alpha():
    assert smoothed_alpha(5, 5) == pytest.approx(6 / 7)
    assert smoothed_alpha(0, 5) == pytest.approx(1 / 7)


def test_speculation_needs_its_estimate_less_its_noise_to_pay(engine_model):
    """The margin is the estimate's own spread: a candidate drafts only where its acceptance
    less ``noise_z`` standard deviations still beats plain decoding at the chosen gamma."""
    model = engine_model("llama-gqa")
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0)
    n, layers = 1000, model.cfg.num_layers
    selector = KnapSpecSelector(profile)
    plain = 1 / profile.verify_time(1, n)
    candidate = [Candidate(frozenset({2, 4}), 2, 0.99)]
    draft = profile.draft_time(candidate[0].skipped, n, layers)
    verify = lambda q: profile.verify_time(q, n)  # noqa: E731
    outcomes = set()
    for agree, positions in ((5, 5), (30, 30), (50, 55), (2, 5), (400, 420)):
        alphas, lowers = fit_acceptance(selector.book, candidate, [agree], positions,
                                        selector.config.noise_z)
        assert alphas == [pytest.approx((agree + 1) / (positions + 2))]  # no run seen yet
        lower = lowers[0]
        assert lower < alphas[0]
        best = tpt.search(alphas, [draft], verify)
        choice = choose_by_tpt(profile, candidate, alphas, lowers, n, layers, selector.config,
                               selector.book.exit_rate)
        pays = (best.candidate is not None
                and tpt.tokens_per_time(lower, best.gamma, draft, verify) >= plain)
        assert choice == (best if pays else tpt.Choice(None, 0, plain))
        outcomes.add(pays)
        if not pays:  # the plain choice's frontier keeps the margin it was turned down by
            selector.remember(Selection(n, selector.weights(n, layers), candidate, alphas,
                                        choice, Plan(frozenset(), 0), positions),
                              alphas, lowers, 1)
            assert selector.spare_rule.frontier.lower == [lower]
    assert outcomes == {True, False}  # both sides of the margin are exercised


def test_guard_drops_a_plan_that_loses_and_lowers_the_realized_ratio(engine_model, monkeypatch):
    """A plan whose drafts are rejected falls back to plain decoding after GUARD_ROUNDS rounds,
    and the realized/predicted acceptance ratio (what the spare rule prices) falls with it."""
    model = engine_model("llama-gqa")
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=100.0)
    selector = KnapSpecSelector(profile, KnapSpecConfig(interval=10_000))
    selector.start(model)
    assert selector.schedule.next_selection == selector.config.m  # m generated tokens first
    selector.schedule.next_selection = 0
    skip, n = frozenset({2, 3}), 100
    selected = []
    reference = type("R", (), {"states": torch.zeros(1, selector.config.m, 1)})()
    monkeypatch.setattr(selector, "references", lambda batch: [reference])

    def select(model, batch, references):  # what select() records for a plan, at alpha 0.9
        selector.guard.watch(PlanRun(n, 0.9, profile.draft_time(skip, n, model.cfg.num_layers)))
        selected.append(selector.guard.realized_ratio)
        return type("S", (), {"plan": Plan(skip, 3)})()

    monkeypatch.setattr(selector, "select", select)
    batch = type("B", (), {"lengths": [n], "progress": 0.0, "size": 1,
                           "cache": type("C", (), {"lengths": [n]})(),
                           "rows": [type("R", (), {"rid": 0, "limit": 1000, "out": []})()]})()
    selector.states = {0: [[None]] * selector.config.m}  # m rounds observed: a DP can run
    assert selector.plan(model, batch) == Plan(skip, 3)
    for i in range(PlanRun.GUARD_ROUNDS):
        batch.progress = i + 1
        assert selector.plan(model, batch) == Plan(skip, 3)
        selector.record(3, [3], [0])  # every draft rejected: one token per round, higher cost
    batch.progress = 9
    assert selector.plan(model, batch) == Plan(frozenset(), 0)
    assert selector.fallbacks == 1
    assert selector.guard.realized_ratio == pytest.approx(1 / (0.9 * 3 * PlanRun.GUARD_ROUNDS + 1))
    selector.record(3, [3], [0])  # no plan in force: nothing recorded
    assert selector.guard.realized_ratio == pytest.approx(1 / (0.9 * 3 * PlanRun.GUARD_ROUNDS + 1))


def test_guard_keeps_a_plan_that_pays(engine_model):
    model = engine_model("llama-gqa")
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=100.0)
    run = PlanRun(100, 0.9, profile.draft_time(frozenset({2, 3}), 100, model.cfg.num_layers))
    for _ in range(PlanRun.GUARD_ROUNDS):
        run.rounds, run.tokens = run.rounds + 1, run.tokens + 4
        run.modeled_s += 3 * run.draft_time + profile.verify_time(4, 100)
    assert not run.losing(profile)
    run.tokens = run.rounds  # the same rounds had yielded one token each
    assert run.losing(profile)


def test_fused_prefix_attention_matches_plain_ops():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, r, 16, generator=gen) for r in (30, 500, 500))
    out, lse = prefix_attention(q, k, v, 0.25)
    want_out, want_lse = reference_prefix_attention(q, k, v, 0.25)
    assert torch.allclose(out, want_out, atol=1e-5)
    assert torch.allclose(lse, want_lse, atol=1e-5)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-headdim"])
def test_dp_states_equal_a_drafted_forward(engine_model, name):
    """The DP's state for a skip set is what the draft with that skip set computes at the m
    reference positions of each reference row: the full model's K/V for that row's prefix, its
    own K/V for the m tokens."""
    model = engine_model(name)
    gen = torch.Generator().manual_seed(11)
    lengths = [90, 61]  # two rows of a batch, each with its own prefix
    prompts = [torch.randint(2, 256, (1, n), generator=gen) for n in lengths]
    m, items = 5, 2 * model.cfg.num_layers
    skip = frozenset(int(i) for i in torch.randperm(items, generator=gen)[:items // 3])
    cache = KVCache(model.cfg, 2, 100, dtype=model.dtype, device="cpu")
    references, drafted = [], []
    with torch.inference_mode():
        for row, (n, prompt) in enumerate(zip(lengths, prompts)):
            rows = slice(row, row + 1)
            model(prompt[:, :-m], [0], cache, rows)
            cache.commit(row, n - m)
            full = Capture()
            model(prompt[:, -m:], [n - m], cache, rows, capture=full)
            references.append(Reference(row, n - m, torch.stack([h[0] for h in full])))
        evaluator = HiddenStateEvaluator(model, cache, references)
        for item in range(items):
            evaluator.evaluate(item, [0], item not in skip)
            evaluator.keep(item, {0: (0, item not in skip)})
        for row, (n, prompt) in enumerate(zip(lengths, prompts)):
            draft = Capture()
            model(prompt[:, -m:], [n - m], cache, slice(row, row + 1), skip=skip, capture=draft)
            drafted.append(draft[-1][0])
    got, want = evaluator.current[0], torch.cat(drafted)
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-4)
    full_states = torch.cat([r.states[-1] for r in references])
    assert not torch.allclose(got, full_states, atol=1e-3, rtol=1e-4)


def test_pruned_dp_chooses_what_the_full_dp_chooses(engine_model, monkeypatch):
    """The DP drops states that cannot reach the least weight that could pay
    (``least_paying_weight``): its candidates are the full DP's at or above that weight, and
    the plan chosen from them is the full DP's, at every price (acceptance stood in by a
    function of each candidate's value, so that some plans pay)."""
    model = engine_model("llama-gqa")
    gen = torch.Generator().manual_seed(5)
    m, cache, references = 5, KVCache(model.cfg, 2, 100, dtype=model.dtype, device="cpu"), []
    with torch.inference_mode():
        for row, n in enumerate((80, 64)):
            prompt = torch.randint(2, 256, (1, n), generator=gen)
            model(prompt[:, :-m], [0], cache, slice(row, row + 1))
            cache.commit(row, n - m)
            full = Capture()
            model(prompt[:, -m:], [n - m], cache, slice(row, row + 1), capture=full)
            references.append(Reference(row, n - m, torch.stack([h[0] for h in full])))
    batch = Batch(cache, rows=[Row(0, [], 10), Row(1, [], 10)])
    monkeypatch.setattr(knapspec, "fit_acceptance", lambda book, candidates, *a: (
        [smoothed_alpha(m, m) * c.value ** 4 for c in candidates], None))
    pruned_any = speculated = plain = slack = 0
    steep = [(60, 1e-3), (100, 4e-2)]  # attention 40x dearer 40 tokens on
    for attention, scale in [(LINEAR_ATTENTION, s) for s in (1.0, 1.3, 1.6, 2.0, 3.0, 6.0)] + \
            [(steep, s) for s in (0.8, 1.0, 1.3)]:
        profile = synthetic_profile(model, attention, verify_growth=0.1, verify_scale=scale)
        selector = KnapSpecSelector(profile)
        with torch.inference_mode():
            pruned = selector.select(model, batch, references)
            with monkeypatch.context() as patch:
                patch.setattr(SpareRule, "least_paying_weight", lambda *a: 1)
                whole = KnapSpecSelector(profile).select(model, batch, references)
        n, layers = pruned.context, model.cfg.num_layers
        fresh = KnapSpecSelector(profile)

        def least_paying(c):
            return fresh.spare_rule.least_paying_weight(fresh.prices(layers), pruned.weights, c,
                                                        2 * m)
        # pruned below the least weight that could pay here or at 1.25 n
        useful = min(least_paying(c) for c in (n, math.ceil(1.25 * n)))
        kept = [c for c in whole.candidates if c.skipped_weight >= useful]
        # (values to float precision: fewer states in a batched forward may round differently)
        assert [(c.skipped, c.skipped_weight) for c in pruned.candidates] == \
            [(c.skipped, c.skipped_weight) for c in kept]
        assert [c.value for c in pruned.candidates] == pytest.approx([c.value for c in kept])
        assert pruned.plan == whole.plan
        assert pruned.choice.tokens_per_time == pytest.approx(whole.choice.tokens_per_time)
        pruned_any += len(pruned.candidates) < len(whole.candidates)
        speculated += pruned.plan.gamma > 0
        plain += pruned.plan.gamma == 0
        if pruned.plan.gamma == 0:  # the subnets it left out could not pay up to 1.25 n,
            assert selector.spare_rule.frontier.useful_from == useful  # where it is reused
            slack += useful < least_paying(n)
    assert pruned_any and speculated and plain and slack  # the prices cover every case


def test_references_spread_m_positions_over_the_longest_rows(engine_model):
    """In a batch the DP judges drafts on m positions in all: the last 3 of the longest row
    and the last 2 of the next (m = 5, two reference rows), each starting where its kept
    positions do."""
    model = engine_model("llama-gqa")
    selector = KnapSpecSelector(synthetic_profile(model, LINEAR_ATTENTION))
    selector.start(model)
    cache = KVCache(model.cfg, 3, 64, dtype=model.dtype, device="cpu")
    for slot, length in enumerate((20, 40, 30)):
        cache.commit(slot, length)
    batch = Batch(cache, rows=[Row(rid, [], 10) for rid in (7, 8, 9)])
    layers = model.cfg.num_layers
    for position in range(6):  # a [2L + 1, d] state per position, valued by row and position
        hidden = [torch.tensor([[[100.0 * rid + position]] for rid in (7, 8, 9)])
                  for _ in range(2 * layers + 1)]
        selector.observe(hidden, [1, 1, 1], [7, 8, 9])
    refs = selector.references(batch)
    assert [(r.slot, r.start, r.states.shape[1]) for r in refs] == [(1, 37, 3), (2, 28, 2)]
    assert refs[0].states[0, :, 0].tolist() == [803.0, 804.0, 805.0]
    assert refs[1].states[0, :, 0].tolist() == [904.0, 905.0]
