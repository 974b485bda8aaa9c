"""No unplanned host sync in a round: on CUDA every read of a device value
(``.item()``, ``bool(t)``, ``.tolist()``) waits for the stream, and so does every tensor made
from host numbers with a pageable copy. A dispatch mode counts both in each round on the CPU:
a decode round makes exactly its one upload (``Batch.inputs``, pinned and non-blocking on a
GPU) and its one read-back; a speculative round the same, plus one read per draft token only
with early exit."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.sampling import SamplingConfig
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.selfspec import SelfSpeculative, StaticSelector

from conftest import random_prompt

NAME = "llama-gqa"
READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
         torch.ops.aten.is_nonzero.default}


class HostTraffic(TorchDispatchMode):
    """Counts host reads and tensors made from host data (``torch.tensor(list)``, which
    dispatches ``lift_fresh``; a 0-d one is a Python scalar an op takes, never a copy)."""

    def __init__(self):
        super().__init__()
        self.reads = self.made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.reads += 1
        elif func is torch.ops.aten.lift_fresh.default and args[0].dim() > 0:
            self.made += 1
        return func(*args, **(kwargs or {}))


def count_rounds(strategy, monkeypatch) -> list[tuple[int, int]]:
    """(host reads, host-made tensors) of every round ``strategy`` runs from now on."""
    rounds = []
    real_round, real_tolist = strategy.round, torch.Tensor.tolist

    def counted(*args, **kwargs):
        mode = HostTraffic()

        def tolist(t):
            mode.reads += 1
            return real_tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        try:
            with mode:
                real_round(*args, **kwargs)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)
        rounds.append((mode.reads, mode.made))

    monkeypatch.setattr(strategy, "round", counted)
    return rounds


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, seed=5),
                                      SamplingConfig(temperature=0.8, seed=5, method="rejection")],
                         ids=["greedy", "sampling", "rejection"])
@pytest.mark.parametrize("name,early_exit", [("ar", True), ("static", False), ("static", True)])
def test_a_round_uploads_once_and_reads_back_once(engine_model, monkeypatch, name, early_exit,
                                                   graphs, sampling):
    model = engine_model(NAME)
    prompts = [random_prompt(n, model.cfg.vocab_size, seed=80 + n) for n in (8, 30, 51)]
    config = GenerationConfig(max_new_tokens=12, stop_at_eos=False, sampling=sampling)
    gamma = 3
    strategy = (Autoregressive() if name == "ar"
                else SelfSpeculative(StaticSelector(frozenset({1, 4}), gamma), tau_conf=0.5))
    runner = ModelRunner(model, graphs=graphs)
    runner.early_exit = early_exit
    rounds = count_rounds(strategy, monkeypatch)
    generate(strategy, model, prompts, config, runner=runner)
    assert rounds
    assert all(made == 1 for _, made in rounds), rounds
    if name == "ar" or not early_exit:
        assert all(reads == 1 for reads, _ in rounds), rounds
    else:  # one read per draft token (none where no row has room left), plus the read-back
        assert all(1 <= reads <= gamma + 1 for reads, _ in rounds), rounds
        assert any(reads > 1 for reads, _ in rounds), rounds
