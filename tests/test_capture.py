"""CUDA graph capture semantics on the CPU (engine/capture.py): the emulation itself, and every
strategy's graph path under it, which must give plain eager ``ar``'s tokens. ``EagerGraph`` runs
the function while "capturing", so only these tests see a graph's output read before a replay
has written it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from knapspec_dist.engine import model_runner
from knapspec_dist.engine.capture import CaptureError, EmulatedGraph
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.scheduler import Scheduler, generate
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.speculation.options import StrategyOptions

from conftest import random_prompt
from synthetic import LINEAR_ATTENTION, synthetic_profile

NAME = "llama-gqa"
CONFIG = GenerationConfig(max_new_tokens=20, stop_at_eos=False)


def test_capture_runs_no_mutation_and_poisons_fresh_outputs():
    static = torch.tensor([1.0, 2.0])
    buffer = torch.zeros(2)
    index = torch.tensor([0, 1])

    def fn():
        doubled = static * 2
        buffer.copy_(doubled)
        return doubled, index + 1

    graph = EmulatedGraph(fn)
    buffer.zero_()  # undo the warm-up, which runs as CUDA's does
    doubled, shifted = graph.output
    assert doubled.isnan().all() and (shifted == torch.iinfo(torch.long).max).all()
    assert (buffer == 0).all()  # the copy was recorded, not run
    static.copy_(torch.tensor([3.0, 4.0]))  # a replay reads the static input as it is then
    graph.replay()
    assert doubled.tolist() == [6.0, 8.0] and buffer.tolist() == [6.0, 8.0]
    assert shifted.tolist() == [1, 2]


def test_a_host_read_during_capture_raises():
    x = torch.ones(3)
    with pytest.raises(CaptureError):
        EmulatedGraph(lambda: x * float(x.sum()))
    with pytest.raises(CaptureError):
        EmulatedGraph(lambda: x.tolist())


def _strategy(name: str, model):
    options = {"ar": {}, "static": {"skip": "a1,m2", "gamma": 4},
               "knapspec": {"interval": 8}, "clasp": {"interval": 8, "gamma": 3}}[name]
    profiles = ([synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=100.0)]
                if name in ("knapspec", "clasp") else None)
    return build_strategy(StrategyOptions(name=name, tau_conf=0.0, **options), model, profiles)


@pytest.mark.parametrize("name,draft_graphs", [
    ("ar", "plan"), ("static", "plan"), ("static", "pieces"), ("clasp", "plan"),
    ("clasp", "pieces"), ("knapspec", "plan"), ("knapspec", "pieces")])
def test_emulated_capture_gives_the_tokens_of_eager_ar(engine_model, name, draft_graphs):
    """Decode, verify and draft graphs captured as CUDA captures them, replayed for rounds of
    two rows, then one (three prompts, two at a time): eager ``ar``'s tokens."""
    model = engine_model(NAME)
    prompts = [random_prompt(n, model.cfg.vocab_size, seed=60 + n) for n in (9, 40, 75)]
    expected = generate(Autoregressive(), model, prompts, CONFIG,
                        runner=ModelRunner(model, graphs=False))
    runner = ModelRunner(model, graphs=True, graph_factory=EmulatedGraph)
    runner.draft_graphs = draft_graphs
    got = generate(_strategy(name, model), model, prompts, CONFIG, max_num_seqs=2,
                   runner=runner)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert runner.captures > 0
    if name != "ar":
        assert sum(r.stats.drafted for r in got) > 0, "speculation never ran"
    if draft_graphs == "pieces":
        assert runner._piece_sets, "the per-sublayer draft graphs never ran"


@pytest.mark.parametrize("name,draft_graphs", [("ar", "plan"), ("static", "pieces")])
def test_emulated_capture_of_compiled_flex_with_batch_buckets(engine_model, monkeypatch,
                                                             flex_compiles, name,
                                                             draft_graphs):
    """The CUDA default path: flex attention compiled by dynamo (a counting backend on the
    CPU), its graphs captured as CUDA captures them, batches padded to their buckets while
    rows join 16 prompt tokens a step (batch 1, 2, 3 padded to 4, 4, and back): eager SDPA
    ``ar``'s tokens."""
    model = engine_model(NAME)
    prompts = [random_prompt(n, model.cfg.vocab_size, seed=70 + n) for n in (9, 40, 75, 23)]
    expected = generate(Autoregressive(), model, prompts, CONFIG,
                        runner=ModelRunner(model, graphs=False))
    padded = []
    real_padded = model_runner.padded_forward

    def counted(*args, **kwargs):
        out = real_padded(*args, **kwargs)
        padded.append(out is not None)
        return out

    monkeypatch.setattr(model_runner, "padded_forward", counted)
    counter = flex_compiles
    model.backend = "flex"
    try:
        runner = ModelRunner(model, graphs=True, graph_factory=EmulatedGraph)
        runner.draft_graphs = draft_graphs
        capacity = row_capacity(max(map(len, prompts)), CONFIG.max_new_tokens)
        got = Scheduler(_strategy(name, model), model,
                        replace(CONFIG, max_num_batched_tokens=16), 4, capacity,
                        runner=runner).run(prompts)
    finally:
        model.backend = None
        torch._dynamo.reset()  # no counted graphs left for later tests
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert runner.captures > 0 and counter.frame_count > 0, "no compiled flex graph captured"
    assert any(padded), "no forward ran padded to its bucket"
    if name != "ar":
        assert sum(r.stats.drafted for r in got) > 0, "speculation never ran"
