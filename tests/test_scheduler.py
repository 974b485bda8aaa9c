"""Continuous batching (speculation/scheduler.py, batch.py) and batch pricing
(profiles/batching.py): rows admitted as others finish, prefilled in chunks, decoded together,
give exactly the tokens each row gets alone."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from knapspec_dist.engine import scheduler as scheduler_module
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import prefill
from knapspec_dist.engine.sampling import SamplingConfig
from knapspec_dist.engine.scheduler import (
    Scheduler,
    default_max_num_batched_tokens,
    max_num_batched_tokens,
)
from knapspec_dist.engine.sequence import Batch, Row, row_capacity
from knapspec_dist.errors import UserError
from knapspec_dist.model.cache import KVCache
from knapspec_dist.profiles import batching
from knapspec_dist.profiles.batching import BatchPricing
from knapspec_dist.speculation import knapsack, tpt
from knapspec_dist.speculation.acceptance import smoothed_alpha
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.knapspec import (
    KnapSpecConfig,
    KnapSpecSelector,
    Selection,
    choose_by_tpt,
)
from knapspec_dist.speculation.schedule import Frontier
from knapspec_dist.speculation.selfspec import Plan, SelfSpeculative

from batching import STRATEGIES
from conftest import random_prompt
from synthetic import LINEAR_ATTENTION, synthetic_profile

NAME = "llama-gqa"
LENGTHS = (9, 70, 23, 140, 4)


def prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(n, vocab, seed=300 + n) for n in LENGTHS]


def run(strategy, model, config, max_num_seqs: int, chunk: int = 512):
    ps = prompts(model.cfg.vocab_size)
    capacity = max(row_capacity(len(p), config.max_new_tokens) for p in ps)
    sched = Scheduler(strategy, model, replace(config, max_num_batched_tokens=chunk),
                      max_num_seqs, capacity)
    return sched.run(ps), sched


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_batched_rows_get_the_tokens_they_get_alone(engine_model, name):
    """Rows of mixed lengths, 2 decoding at once, admitted as others finish, long prompts
    prefilled in 16-token chunks between rounds: every row's greedy tokens equal batch-1 ar."""
    model = engine_model(NAME)
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=100.0)
    config = GenerationConfig(max_new_tokens=20, stop_at_eos=False)
    alone, _ = run(Autoregressive(), model, config, max_num_seqs=1)
    batched, sched = run(STRATEGIES[name](profile), model, config, max_num_seqs=2, chunk=16)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert sched.work.mean_batch > 1.5 and sched.work.finished == 5 * 20
    assert all(r.stats.admitted_at <= r.stats.finished_at for r in batched)
    w = sched.work  # the live Work a job's ETA reads (jobs/progress.py)
    assert (w.emitted, w.decoded, w.prefilled) == (5 * 20, 5 * 20 - 5, sum(LENGTHS))
    assert sum(r.stats.rounds for r in batched) == w.row_rounds and w.rounds < w.row_rounds
    if name == "knapspec":
        assert sum(r.stats.drafted for r in batched) > 0, "speculation never ran"


def counting_steps() -> tuple[list[tuple[int, int]], Callable[[Scheduler], None]]:
    """(prompt tokens prefilled, decoding rounds run) of each step of a run, and the run's
    ``on_step`` hook that appends them."""
    steps, last = [], [0, 0]

    def counted(sched: Scheduler) -> None:
        now = [sched.work.prefilled, sched.work.rounds]
        steps.append((now[0] - last[0], now[1] - last[1]))
        last[:] = now

    return steps, counted


@pytest.mark.parametrize("name", ["ar", "knapspec"])
def test_a_small_prefill_budget_chunks_prompts_across_steps_and_changes_no_token(
        engine_model, name):
    """Budgets of 1, 7 and 64 prompt tokens a step (a budget of 1: the 140-token prompt over
    140 steps, rows decoding between them) give the default budget's tokens; no step
    prefills more than its budget, and every prompt token is prefilled once."""
    model = engine_model(NAME)
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=100.0)
    config = GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    ps = prompts(model.cfg.vocab_size)
    cap = max(row_capacity(len(p), config.max_new_tokens) for p in ps)
    default = Scheduler(STRATEGIES[name](profile), model, config, 3, cap)
    assert default.max_num_batched_tokens == default_max_num_batched_tokens(model.device)
    first, counted = counting_steps()
    want = [r.token_ids for r in default.run(ps, on_step=counted)]
    assert first[0][0] >= sum(LENGTHS[:3])  # the default prefills the first rows at once
    for budget in (1, 7, 64):
        sched = Scheduler(STRATEGIES[name](profile), model,
                          replace(config, max_num_batched_tokens=budget), 3, cap)
        steps, counted = counting_steps()
        got = sched.run(ps, on_step=counted)
        assert [r.token_ids for r in got] == want, budget
        prefilled = [p for p, _ in steps]
        assert max(prefilled) == budget and sum(prefilled) == sum(LENGTHS)
        assert len(steps) >= sum(LENGTHS) // budget
        assert any(p and r for p, r in steps)  # rows decoded in steps that prefilled others
        if name == "knapspec":
            assert sum(r.stats.drafted for r in got) > 0, "speculation never ran"


def test_a_rows_prefill_chunks_depend_on_its_prompt_alone(engine_model, monkeypatch):
    """Chunks start at multiples of the budget, whatever was prefilled before them in the
    step: the same chunks at 1 and 3 rows in flight, each a whole budget but the last."""
    model = engine_model(NAME)
    config = GenerationConfig(max_new_tokens=4, stop_at_eos=False, max_num_batched_tokens=64)
    ps = prompts(model.cfg.vocab_size)
    cap = max(row_capacity(len(p), config.max_new_tokens) for p in ps)
    calls: list[tuple[int, int]] = []

    def recorded(model, cache, row, tokens, start=0, capture=None):
        calls.append((start, len(tokens)))
        return prefill(model, cache, row, tokens, start, capture)

    monkeypatch.setattr(scheduler_module, "prefill", recorded)
    chunks = {}
    for rows in (1, 3):
        calls.clear()
        Scheduler(Autoregressive(), model, config, rows, cap).run(ps)
        chunks[rows] = sorted(calls)
    want = sorted((s, min(64, n - s)) for n in LENGTHS for s in range(0, n, 64))
    assert chunks[1] == chunks[3] == want


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "64"])
def test_a_bad_prefill_budget_is_a_user_error(bad):
    with pytest.raises(UserError, match="--max-num-batched-tokens must be an integer >= 1"):
        GenerationConfig(max_num_batched_tokens=bad)
    with pytest.raises(UserError, match="--max-num-batched-tokens"):
        GenerationConfig.of(max_num_batched_tokens=bad)


def test_the_default_prefill_budget_is_the_devices():
    assert default_max_num_batched_tokens(torch.device("cpu")) == 8192
    assert default_max_num_batched_tokens(torch.device("cuda", 3)) == 8192
    asked = GenerationConfig(max_num_batched_tokens=100)
    assert max_num_batched_tokens(asked, torch.device("cuda")) == 100
    assert max_num_batched_tokens(GenerationConfig(), "cuda") == 8192


def test_batched_sampling_runs_per_row(engine_model):
    model = engine_model(NAME)

    config = GenerationConfig(max_new_tokens=12, stop_at_eos=False,
                              sampling=SamplingConfig(temperature=0.9, seed=5))
    results, _ = run(STRATEGIES["static"](None), model, config, max_num_seqs=3)
    assert [len(r.token_ids) for r in results] == [12] * len(LENGTHS)
    assert all(0 <= t < model.cfg.vocab_size for r in results for t in r.token_ids)


def test_retire_keeps_rows_packed_with_their_cache(engine_model):
    """A finished row's slot takes the last decoding row (its K/V and length), and the row
    being prefilled moves down behind it."""
    model = engine_model(NAME)
    cache = KVCache(model.cfg, 4, 32, dtype=model.dtype, device="cpu")
    for row, n in enumerate((5, 7, 9, 3)):
        for t in cache.k + cache.v:
            t[row, :, :n] = row + 1
        cache.commit(row, n)
    rows = [Row(i, [1] * 4, 8) for i in range(3)]
    batch = Batch(cache, rows[:], prefilling=Row(3, [1] * 4, 8))
    batch.retire([rows[0]])
    assert [r.rid for r in batch.rows] == [2, 1] and cache.lengths[:3] == [9, 7, 3]
    assert all((t[0, :, :9] == 3).all() and (t[2, :, :3] == 4).all() for t in cache.k + cache.v)
    assert cache.lengths[3] == 0


def test_a_row_that_cannot_fit_is_refused_alone(engine_model):
    model = engine_model(NAME)
    config = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    sched = Scheduler(Autoregressive(), model, config, 2, capacity=row_capacity(40, 8))
    sched.add(0, random_prompt(30, model.cfg.vocab_size, seed=1))
    with pytest.raises(UserError, match="cache positions"):
        sched.add(1, random_prompt(260, model.cfg.vocab_size, seed=2))  # cache: 256 per row
    done = []
    while sched.busy:
        done += sched.step()
    assert [r.rid for r in done] == [0] and len(done[0].out) == 8


def test_batch_pricing_interpolates_between_measured_batches(engine_model, caplog,
                                                             monkeypatch):
    model = engine_model(NAME)
    one = synthetic_profile(model, LINEAR_ATTENTION)
    eight = synthetic_profile(model, LINEAR_ATTENTION, verify_scale=3.0)
    eight.batch, eight.mlp, eight.head = 8, 3 * one.mlp, 3 * one.head
    pricing = BatchPricing([eight, one])
    at4 = pricing.at(4)
    assert at4.batch == 4 and at4.mlp == pytest.approx(one.mlp * (1 + 2 * 3 / 7))
    assert at4.verify_time(2, 500) == pytest.approx(
        one.verify_time(2, 500) + (eight.verify_time(2, 500) - one.verify_time(2, 500)) * 3 / 7)
    monkeypatch.setattr(batching, "_NOTED", set())  # the note is logged once per process
    with caplog.at_level(logging.WARNING, logger="knapspec_dist.profiles.batching"):
        at32 = pricing.at(32)  # beyond the measured: the line through 1 and 8, continued
    assert "no latency profile at batch 32" in caplog.text and "extrapolating" in caplog.text
    assert at32.batch == 32 and at32.mlp == pytest.approx(one.mlp * (1 + 2 * 31 / 7))
    assert at32.verify_time(2, 500) == pytest.approx(
        one.verify_time(2, 500) + (eight.verify_time(2, 500) - one.verify_time(2, 500)) * 31 / 7)
    assert pricing.at(1) is one and BatchPricing([eight]).at(32) is eight  # nothing to go by


def test_extrapolated_batches_never_cost_less_than_the_largest_measured(engine_model):
    """Noise that made batch 8 cheaper than batch 1 in some coefficient is not continued."""
    model = engine_model(NAME)
    one = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.3)
    eight = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.1)
    eight.batch, eight.head = 8, one.head / 2
    far = BatchPricing([one, eight]).at(256)
    assert far.head == eight.head and far.mlp == eight.mlp
    for q in (1, 5, 11):
        assert far.verify_time(q, 500) >= eight.verify_time(q, 500)


def at_batch(model, batch: int, growth: float, scale: float):
    """A profile of ``batch`` rows: every cost ``scale`` times batch 1's, and a verify of q
    tokens ``1 + growth (q - 1)`` times a decode step (growth 1: compute-bound)."""
    p = synthetic_profile(model, [(n, scale * t) for n, t in LINEAR_ATTENTION],
                          mlp=scale * 7e-4, verify_growth=growth)
    p.batch, p.head = batch, scale * p.head
    return p


def test_the_draft_shortens_to_plain_decoding_as_verify_becomes_compute_bound(
        engine_model, caplog, monkeypatch):
    """As the batch grows a verify's cost grows with its tokens per row (memory-bound at
    batch 1, compute-bound at 256): the selector's price at each batch drafts shorter, and
    plain decoding wins at 256, whether batch 256 was measured or extrapolated from 1 and 8
    (priced as batch 8, flat, it would still draft 3 tokens)."""
    model = engine_model(NAME)
    layers = model.cfg.num_layers
    draft = [knapsack.Candidate(frozenset(range(1, 2 * layers - 2)), 6, 0.9)]
    measured = [at_batch(model, 1, 0.0, 1.0), at_batch(model, 8, 0.15, 1.2)]
    wide = measured + [at_batch(model, 64, 0.5, 4.0), at_batch(model, 256, 1.0, 12.0)]
    monkeypatch.setattr(batching, "_NOTED", set())
    for profiles in (measured, wide):
        selector = KnapSpecSelector(profiles, KnapSpecConfig())

        def gamma(batch: int) -> int:
            return choose_by_tpt(selector.price(batch), draft, [0.9], None, 500, layers,
                                 selector.config, 0.0).gamma

        with caplog.at_level(logging.WARNING, logger="knapspec_dist.profiles.batching"):
            gammas = [gamma(b) for b in (1, 8, 16, 32, 64, 128, 256)]
        assert gammas == sorted(gammas, reverse=True), gammas
        assert gammas[0] > gammas[1] > 0 and gammas[-1] == 0, gammas
    assert "no latency profile at batch 16 (measured: [1, 8]): extrapolating" in caplog.text
    assert "measured: [1, 8, 64, 256]" not in caplog.text  # inside the measured: no guess


def test_selection_is_skipped_where_no_draft_could_pay(engine_model):
    """A verify whose cost grows steeply with its tokens (a compute-bound batch): even drafts
    all judged right from the cheapest subnet lose, so the DP never runs and decoding is plain."""
    model = engine_model(NAME)
    layers = model.cfg.num_layers
    steep = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=1.0)
    flat = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=100.0)
    config = GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    for profile, pays in ((steep, False), (flat, True)):
        selector = KnapSpecSelector(profile, KnapSpecConfig(interval=8))
        empty = type("B", (), {"rows": []})()
        assert selector.nothing_pays(empty, 100, layers, positions=10) is not pays
        results, _ = run(SelfSpeculative(selector, name="knapspec"), model, config, 3)
        assert (selector.schedule.spared > 0 and not selector.history) is not pays
        if not pays:
            assert sum(r.stats.drafted for r in results) == 0


def test_least_paying_weight_is_the_exact_threshold(engine_model):
    """Below the weight it returns, no subnet (drafting at the best acceptance the DP can
    estimate) beats plain decoding by min_gain; at it, the bound's draft time does."""
    model = engine_model(NAME)
    layers = model.cfg.num_layers
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.3)
    selector = KnapSpecSelector(profile, KnapSpecConfig())
    n, positions = 2000, 5
    weights = selector.weights(n, layers)
    j = selector.spare_rule.least_paying_weight(selector.prices(layers), weights, n, positions)
    assert 1 < j <= sum(weights)
    per_weight = max((profile.attention_time(n), profile.mlp_time())[i % 2] / w
                     for i, w in enumerate(weights))
    full = profile.draft_time(frozenset(), n, layers)

    def best(skipped_weight):
        return max(tpt.tokens_per_time(smoothed_alpha(positions, positions), g,
                                       full - skipped_weight * per_weight,
                                       lambda q: profile.verify_time(q, n)) for g in range(1, 11))

    needed = 1.05 / profile.verify_time(1, n)
    assert best(j) >= needed > best(j - 1)


def test_a_fruitless_selection_spares_the_next_where_its_frontier_cannot_pay(engine_model):
    """After a DP found nothing worth drafting at context n, a due selection at a context up
    to 1.25 n is skipped if, priced at the batch size of the moment, neither the subnets that
    DP returned nor those it did not evaluate could pay, until the decoding since (priced by
    the profile) is 100 times what the DP cost (RECHECK_SHARE)."""
    model = engine_model(NAME)
    layers = model.cfg.num_layers
    one = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.1)
    selector = KnapSpecSelector(one, KnapSpecConfig())
    rule, schedule = selector.spare_rule, selector.schedule
    weights = selector.weights(1000, layers)
    useful = rule.least_paying_weight(selector.prices(layers), weights, 1000, 5)
    skip = frozenset(range(2, 2 * layers - 2))  # all but the first and last layer
    assert sum(weights[i] for i in skip) >= useful  # a subnet the DP would return
    rule.frontier = Frontier(1000, weights, useful, [skip], [0.2])
    schedule.last_select_s = 0.5
    # the context grew: redo the DP
    assert not rule.frontier_rules_out(selector.prices(layers), 1300, 5)
    step = one.verify_time(1, 1100)
    due = 0.5 / (rule.RECHECK_SHARE * step)  # rounds of decoding 100x the DP's cost
    for rounds, spared in ((0, True), (int(due) - 1, True), (int(due) + 1, False)):
        schedule.rounds_since_dp = rounds
        assert rule.frontier_rules_out(selector.prices(layers), 1100, 5) is spared
    schedule.rounds_since_dp = 0
    # the same subnet, had it shown a high acceptance, would pay: the DP is redone
    rule.frontier = Frontier(1000, weights, useful, [skip], [0.95])
    assert not rule.frontier_rules_out(selector.prices(layers), 1000, 5)
    # a batch size where drafting is cheaper (a flat verify) makes the unevaluated subnets
    # (those that skipped less than `useful`) worth a look: the DP is redone
    rule.frontier = Frontier(1000, weights, useful, [skip], [0.2])
    selector.profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0,
                                         verify_scale=3.0)
    assert rule.least_paying_weight(selector.prices(layers), weights, 1000, 5) < useful
    assert not rule.frontier_rules_out(selector.prices(layers), 1000, 5)


def test_a_frontier_is_priced_with_the_noise_margin_its_dp_chose_by(engine_model):
    """A DP that turned its subnets down for their margin (the estimate less its noise does
    not beat plain decoding) is not redone at the next due selection on the same prices: its
    frontier is re-priced with the same lower bounds. Without them a subnet whose mean looked
    paying reran the DP for nearly every document of one context."""
    model = engine_model(NAME)
    layers = model.cfg.num_layers
    selector = KnapSpecSelector(synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.1),
                                KnapSpecConfig())
    rule = selector.spare_rule
    selector.schedule.last_select_s, selector.schedule.rounds_since_dp = 0.5, 0
    weights = selector.weights(1000, layers)
    useful = rule.least_paying_weight(selector.prices(layers), weights, 1000, 5)
    skip = frozenset(range(2, 2 * layers - 2))
    rule.frontier = Frontier(1000, weights, useful, [skip], [0.95])  # the mean would pay
    assert not rule.frontier_rules_out(selector.prices(layers), 1000, 5)
    rule.frontier = Frontier(1000, weights, useful, [skip], [0.95], lower=[0.2])
    assert rule.frontier_rules_out(selector.prices(layers), 1000, 5)
    rule.frontier = Frontier(1000, weights, useful, [skip], [0.95], lower=[0.95])
    assert not rule.frontier_rules_out(selector.prices(layers), 1000, 5)


def test_a_dp_is_spared_where_the_batch_has_too_few_tokens_left_to_repay_it(engine_model):
    """Once a DP has cost s seconds, the next runs only if drafting at the best rate any
    subnet could reach, until the longest remaining row is done, could save more than s."""
    model = engine_model(NAME)
    layers = model.cfg.num_layers
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=3.0)
    selector = KnapSpecSelector(profile, KnapSpecConfig())
    weights = selector.weights(1000, layers)
    batch = type("B", (), {"rows": [Row(0, [], 100), Row(1, [], 100)]})()
    rule, prices = selector.spare_rule, selector.prices(layers)
    # no DP yet: priced (verifies flat here, so about one step: every item once, the head)
    assert rule.dp_seconds(prices, weights, 1000, 5) < 1.01 * profile.verify_time(1, 1000)
    assert rule.worth_a_dp(prices, batch, weights, 1000, 5)
    step = profile.verify_time(1, 1000)
    cap = sum(weights) // 2
    gain = step * rule.best_rate(prices, weights, 1000, 5)(cap)
    assert gain > 1.05
    # what 30 tokens could save at best
    selector.schedule.last_select_s = 30 * step * (1 - 1 / gain)
    for left, worth in ((20, False), (29, False), (31, True), (80, True)):
        batch.rows[1].out = [0] * (100 - left)  # the longest row has `left` tokens to go
        batch.rows[0].out = [0] * 99
        assert rule.worth_a_dp(prices, batch, weights, 1000, 5) is worth


def test_a_first_dp_is_priced_by_its_work_and_spared_where_copies_win_the_rounds(
        engine_model):
    """Before any DP has run, its price is each item's forward over its states' reference
    positions (every state the DP could keep, counted by the knapsack itself) and the head
    over the last item's, each a sublayer's step time plus, per further token, a verify's
    measured slope; the time it could save counts only the rounds copied drafts leave to a
    subnet."""
    model = engine_model(NAME)
    layers = model.cfg.num_layers
    growth = 0.05  # a verify's further token costs 5 % of a step
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=growth, verify_scale=3.0)
    selector = KnapSpecSelector(profile, KnapSpecConfig())
    rule, prices = selector.spare_rule, selector.prices(layers)
    weights, n, positions = selector.weights(1000, layers), 1000, 5
    useful = rule.least_paying_weight(prices, weights, n, positions)
    work = knapsack.executed_states(weights, max_skip_fraction=0.5, useful_from=useful,
                                    always_execute=knapsack.first_and_last_layers(2 * layers))
    assert [item for item, _ in work] == list(range(2 * layers))  # every item runs forward
    assert work[0][1] == 1 and max(k for _, k in work) > 1  # one state first, more later
    per_token = growth  # the verifies' slope over a step, as a share of it

    def priced(one: float, tokens: int) -> float:
        return one * (1 + (tokens - 1) * per_token)

    expected = sum(priced(profile.attention_time(n) if i % 2 == 0 else profile.mlp_time(),
                          k * positions) for i, k in work)
    expected += priced(profile.head, work[-1][1] * positions)
    assert rule.dp_seconds(prices, weights, n, positions) == pytest.approx(expected, rel=1e-6)

    # the first DP runs where a subnet could repay its price, and is spared where copied
    # drafts win the rounds it would have drafted in
    step = profile.verify_time(1, n)
    gain = step * rule.best_rate(prices, weights, n, positions)(sum(weights) // 2)
    saved_per_token = step * (1 - 1 / gain)
    left = math.ceil(2 * expected / saved_per_token)  # twice what it costs, at best
    batch = type("B", (), {"rows": [Row(0, [], left + 1)]})()
    assert rule.worth_a_dp(prices, batch, weights, n, positions)
    for won in [True] * 3 + [False]:  # copies won 3 rounds of 4: a quarter left to a subnet
        selector.copied(won)
    assert selector.prices(layers).subnet_share == 0.25
    assert not rule.worth_a_dp(selector.prices(layers), batch, weights, n, positions)


def test_fruitless_dps_in_a_row_stop_new_prices_calling_a_dp_and_back_off_the_recheck(
        engine_model):
    """Hysteresis against calibration's price moves: after one fruitless DP a frontier that
    pays at new prices calls a DP; after two in a row at about this context it does not (each
    such DP finds nothing again), and the periodic re-check's interval doubles per fruitless
    DP in a row, up to MAX_BACKOFF. A longer context restarts
    the count."""
    model = engine_model(NAME)
    layers = model.cfg.num_layers
    one = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.1)
    selector = KnapSpecSelector(one, KnapSpecConfig())
    rule, schedule = selector.spare_rule, selector.schedule
    prices = selector.prices(layers)
    weights = selector.weights(1000, layers)
    useful = rule.least_paying_weight(prices, weights, 1000, 5)
    skip = frozenset(range(2, 2 * layers - 2))
    schedule.last_select_s, schedule.rounds_since_dp = 0.5, 0
    assert rule.fruitless(1000) == 1  # no frontier yet
    rule.frontier = Frontier(1000, weights, useful, [skip], [0.95])  # pays at these prices
    assert rule.fruitless(1100) == 2 and rule.fruitless(1300) == 1  # 1300 > 1.25 x 1000
    assert not rule.frontier_rules_out(prices, 1000, 5)  # one fruitless DP: redo
    rule.frontier = Frontier(1000, weights, useful, [skip], [0.95], fruitless=2)
    assert rule.frontier_rules_out(prices, 1000, 5)  # two in a row: prices alone do not
    assert not rule.frontier_rules_out(prices, 1300, 5)  # a longer context still does
    step = one.verify_time(1, 1100)
    due = 0.5 / (rule.RECHECK_SHARE * step)  # the re-check after one fruitless DP
    for fruitless, backoff in ((1, 1), (2, 2), (3, 4), (4, 8), (9, 8)):
        rule.frontier = Frontier(1000, weights, useful, [skip], [0.2], fruitless=fruitless)
        for rounds, spared in ((int(backoff * due) - 1, True), (int(backoff * due) + 1, False)):
            schedule.rounds_since_dp = rounds
            assert rule.frontier_rules_out(prices, 1100, 5) is spared, (fruitless, rounds)


def test_a_plain_choice_keeps_the_count_of_fruitless_dps_in_a_row(engine_model):
    """``KnapSpecSelector.remember`` stores the streak in the frontier it keeps; a longer
    context restarts it."""
    model = engine_model(NAME)
    selector = KnapSpecSelector(synthetic_profile(model, LINEAR_ATTENTION), KnapSpecConfig())
    weights = selector.weights(1000, model.cfg.num_layers)
    plain = Selection(1000, weights, [], [], tpt.Choice(None, 0, 1.0), Plan(frozenset(), 0))
    for expected in (1, 2, 3):
        selector.remember(plain, [], None, 1)
        assert isinstance(selector.spare_rule.frontier, Frontier)
        assert selector.spare_rule.frontier.fruitless == expected
    selector.remember(Selection(1400, weights, [], [], tpt.Choice(None, 0, 1.0),
                                Plan(frozenset(), 0)), [], None, 1)
    assert selector.spare_rule.frontier.fruitless == 1  # the context grew past 1.25x
