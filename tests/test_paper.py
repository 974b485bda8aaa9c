"""``knapspec:paper``, the authors' selection: one worked example per element, and lossless
against ``ar`` (greedy) with every ablation."""

from __future__ import annotations

import argparse

import pytest
import torch

from knapspec_dist.cli.common import add_strategy_args, strategy_options
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.errors import UserError
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.speculation.knapspec import KnapSpecConfig
from knapspec_dist.speculation.options import StrategyOptions, check_options, parse_strategy
from knapspec_dist.speculation.paper import PaperCadence, PaperSelector, rank
from knapspec_dist.speculation.selfspec import SelfSpeculative

from synthetic import LINEAR_ATTENTION, synthetic_profile


def test_cadence_gathers_rounds_2_to_6_and_selects_at_7_every_64_rounds():
    c = PaperCadence(interval=64, m=5)
    assert [r for r in range(1, 140) if c.gathers(r)] == [2, 3, 4, 5, 6, 66, 67, 68, 69, 70,
                                                          130, 131, 132, 133, 134]
    assert [r for r in range(1, 140) if c.due(r)] == [7, 71, 135]
    once = PaperCadence(interval=64, m=5, once=True)
    assert [r for r in range(1, 140) if once.due(r)] == [7]
    assert [r for r in range(1, 140) if once.gathers(r)] == [2, 3, 4, 5, 6]


def test_rank_orders_subnets_by_tpt_drafts_ten_and_keeps_no_margin():
    """Verify priced 1.0 at any length. Candidate 0 (alpha 0.9, draft 0.8): best TPT at g=1,
    1.9 / 1.8 = 1.056; candidate 1 (alpha 0.5, draft 0.3): 1.5 / 1.3 = 1.154. TPT ranks 1
    first, but the draft length is 10, not TPT's g=1."""
    verify = lambda q: 1.0  # noqa: E731
    best = rank([0.9, 0.5], [0.8, 0.3], verify, max_gamma=10, objective="tpt")
    assert (best.candidate, best.gamma) == (1, 10)
    assert best.tokens_per_time == pytest.approx(1.5 / 1.3)
    # the alpha objective (finding c's ablation) takes the most accurate subnet
    assert rank([0.9, 0.5], [0.8, 0.3], verify, 10, "alpha").candidate == 0
    # no margin: a subnet predicted at 0.58x plain decoding (1.1 / 1.9) still drafts
    losing = rank([0.1], [0.9], verify, max_gamma=10, objective="tpt")
    assert (losing.candidate, losing.gamma) == (0, 10)
    assert losing.tokens_per_time == pytest.approx(1.1 / 1.9)


class Recording(PaperSelector):
    """Keeps what each round saw: (round, plan, committed tokens per row)."""

    def start(self, model):
        super().start(model)
        self.rounds: list[tuple[int, object, list[int]]] = []

    def record(self, drafts, verified, accepted):
        self.rounds.append((self.round, self.plan_now, [a + 1 for a in accepted]))


def run_paper(model, prompts, interval=8, tokens=40, **config):
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=100.0)
    selector = Recording(profile, KnapSpecConfig(interval=interval, **config))
    gen = GenerationConfig(max_new_tokens=tokens, stop_at_eos=False)
    results = generate(SelfSpeculative(selector, tau_conf=0.0, name="knapspec"), model,
                       prompts, gen)
    return selector, results, generate(Autoregressive(), model, prompts, gen)


def test_references_are_every_token_of_the_last_5_rounds_and_alpha_is_raw(engine_model):
    """Each DP judges on every token committed in the window's rounds 2..6 (r of them: 5 at
    the first, made by plain decoding, more once drafts are accepted); each alpha is
    agreements / r, with no prior."""
    model = engine_model("llama-gqa")
    selector, _, _ = run_paper(model, [list(range(2, 60))], interval=16, tokens=120)
    committed = {r: tokens[0] for r, _, tokens in selector.rounds}
    first, second = selector.history[:2]
    assert first.positions == 5
    assert second.positions == sum(committed[r] for r in range(18, 23)) > 5
    for selection in (first, second):  # (agree + 1) / (r + 2) would not be a multiple of 1/r
        for alpha in selection.alphas:
            agree = alpha * selection.positions
            assert agree == pytest.approx(round(agree))


def test_plan_is_fixed_between_selections_with_no_guard(engine_model):
    """Plain decoding until the first DP (round 7); then that DP's subnet at gamma 10 for
    every round of the window, whatever it yields (no guard, no margin)."""
    model = engine_model("llama-gqa")
    selector, results, _ = run_paper(model, [list(range(2, 40))], interval=8, tokens=60)
    plans = {r: plan for r, plan, _ in selector.rounds}
    assert all(plans[r].gamma == 0 for r in range(1, 7))
    chosen = selector.history[0].plan
    assert chosen.gamma == 10 and chosen.skip
    assert all(plans[r] == chosen for r in range(7, 15) if r in plans)
    assert results[0].stats.fallbacks == 0


@pytest.mark.parametrize("name, variant", [
    ("llama-gqa", {}), ("qwen3-headdim", {}), ("llama-tied-llama3rope", {}),
    ("llama-gqa", {"coupled": True}), ("llama-gqa", {"objective": "alpha"}),
    ("llama-gqa", {"select_once": True})])
def test_paper_greedy_equals_ar(engine_model, name, variant):
    model = engine_model(name)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (3, 40, 200)]
    selector, results, expected = run_paper(model, prompts, interval=8, tokens=48, **variant)
    for got, want in zip(results, expected):
        assert got.token_ids == want.token_ids
    assert selector.selections >= (1 if variant.get("select_once") else 2)
    assert sum(r.stats.drafted for r in results) > 0, "speculation never ran"


def test_paper_is_named_like_every_strategy(engine_model):
    """``knapspec:paper`` parses in one place, for generate / job (--strategy) and the bench."""
    spec = parse_strategy("knapspec:paper+coupled")
    assert spec.label == "knapspec:paper+coupled"
    assert spec.options.paper and spec.options.coupled
    p = argparse.ArgumentParser()
    add_strategy_args(p)
    options = strategy_options(p.parse_args(["--strategy", "knapspec:paper", "--select-once"]))
    assert options == StrategyOptions(name="knapspec", paper=True, select_once=True)
    model = engine_model("llama-gqa")
    profile = synthetic_profile(model, LINEAR_ATTENTION)
    assert isinstance(build_strategy(options, model, [profile]).selector, PaperSelector)
    with pytest.raises(UserError, match="unknown flag"):
        parse_strategy("clasp:paper")
    with pytest.raises(UserError, match="interval must be >= 7"):
        check_options(StrategyOptions(name="knapspec", paper=True, interval=6), model.cfg)
