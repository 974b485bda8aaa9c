"""The plan every round of a run gets, per selector, pinned: a change to how the selection is
written must leave the plans it chooses as they were (tokens equal to ``ar`` is not enough: a
different plan also decodes losslessly).

The pinned sequences are in ``plan_sequences.json`` beside this file. The DP's wall time is
priced as zero (the spare rule reads it), so the plans depend on the model and the profile
alone. Regenerate after a deliberate change of the selection with
``KNAPSPEC_PIN_PLANS=1 pytest tests/test_selection_plans.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.speculation import knapspec
from knapspec_dist.speculation.clasp import ClaspSelector
from knapspec_dist.speculation.knapspec import KnapSpecConfig, KnapSpecSelector
from knapspec_dist.speculation.paper import PaperSelector
from knapspec_dist.speculation.selfspec import SelfSpeculative

from synthetic import LINEAR_ATTENTION, synthetic_profile

PINNED = Path(__file__).with_name("plan_sequences.json")
EVERY = dict(interval=8, overhead_budget=1e9)


class Recorder:
    """A selector that keeps the label of every plan it hands out."""

    def __init__(self, inner):
        self.inner, self.plans = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def plan(self, model, batch):
        plan = self.inner.plan(model, batch)
        self.plans.append(plan.label)
        return plan


def selectors(model):
    def profile(growth, scale):
        return synthetic_profile(model, LINEAR_ATTENTION, verify_growth=growth,
                                 verify_scale=scale)

    flat = profile(0.0, 100.0)  # any draft pays
    edge = profile(0.05, 2.0)  # only subnets accepted often pay: many selections choose ar
    bold = KnapSpecConfig(interval=40, overhead_budget=1e9, noise_z=0.0, min_gain=1.0)
    return {
        "knapspec": lambda: KnapSpecSelector(flat, KnapSpecConfig(**EVERY)),
        "knapspec-edge": lambda: KnapSpecSelector(edge, KnapSpecConfig(**EVERY)),
        # a verify that grows steeply with its tokens: every due DP spared
        "knapspec-spared": lambda: KnapSpecSelector(profile(1.0, 1.0), KnapSpecConfig(**EVERY)),
        # no margin, a long interval: the plan chosen loses and the guard drops it
        "knapspec-guarded": lambda: KnapSpecSelector(profile(0.0, 2.0), bold),
        "knapspec-coupled": lambda: KnapSpecSelector(flat, KnapSpecConfig(**EVERY, coupled=True)),
        "knapspec-alpha": lambda: KnapSpecSelector(flat, KnapSpecConfig(**EVERY,
                                                                        objective="alpha")),
        "knapspec-once": lambda: KnapSpecSelector(flat, KnapSpecConfig(select_once=True)),
        "paper": lambda: PaperSelector(flat, KnapSpecConfig(**EVERY)),
        "paper-coupled": lambda: PaperSelector(edge, KnapSpecConfig(**EVERY, coupled=True)),
        "clasp": lambda: ClaspSelector(flat, gamma=3, skip_layers=0.25,
                                       config=KnapSpecConfig(interval=8)),
    }


def run(model, make):
    selector = Recorder(make())
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (3, 40, 200)]
    config = GenerationConfig(max_new_tokens=48, stop_at_eos=False)
    generate(SelfSpeculative(selector, tau_conf=0.0, name="knapspec"), model, prompts, config)
    return {"plans": selector.plans, "selections": selector.selections,
            "fallbacks": selector.fallbacks}


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-headdim"])
def test_every_selector_chooses_the_pinned_plans(engine_model, monkeypatch, name):
    monkeypatch.setattr(knapspec, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    model = engine_model(name)
    got = {variant: run(model, make) for variant, make in selectors(model).items()}
    pinned = json.loads(PINNED.read_text()) if PINNED.exists() else {}
    if os.environ.get("KNAPSPEC_PIN_PLANS"):
        pinned[name] = got
        PINNED.write_text(json.dumps(pinned, indent=1) + "\n")
    assert set(got) == set(pinned[name])
    for variant, run_ in got.items():
        assert run_ == pinned[name][variant], variant
