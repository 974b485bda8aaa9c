"""One interface for every generation strategy: a round of decoding over a batch of rows.

Strategies work on token ids; the caller (cli, engine) turns text into ids and back. In the
spirit of LayerSkip's generation strategies, autoregressive and self-speculative decoding are
interchangeable, so one benchmark runs them side by side on the same prompts. A strategy
says what one round does to every decoding row (``round``); the scheduler (scheduler.py)
admits rows, prefills them and retires them around it, so every strategy is continuously
batched the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from knapspec_dist.clock import Clock
from knapspec_dist.engine.memory import max_num_seqs_for
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.engine.sequence import Batch
from knapspec_dist.engine.generation import (GenerationConfig, GenerationResult,  # noqa: F401 (re-exported)
                         GenerationStats)
from knapspec_dist.engine.scheduler import Scheduler, row_capacity


class Strategy(ABC):
    name: str
    graphs: bool | None = None  # CUDA graphs for decode/verify/draft; None: on CUDA devices
    max_num_seqs: int | None = None  # rows decoding at once; None: every prompt of a call,
    # as far as memory holds them (execution/memory.py)

    def runner(self, model: Transformer) -> ModelRunner:
        """This strategy's runner for ``model``: its reusable cache and captured graphs."""
        runner = getattr(self, "_runner", None)
        if runner is None or runner.model is not model:
            runner = self._runner = ModelRunner(model, self.graphs)
        return runner

    def start(self, model: Transformer) -> None:
        """A batch run begins (selectors reset their schedule)."""

    def admitted(self, rid: int) -> None:
        """Row ``rid`` starts decoding."""

    def retired(self, rid: int) -> None:
        """Row ``rid`` is done."""

    @abstractmethod
    def round(self, model: Transformer, batch: Batch, config: GenerationConfig,
              forward: ModelRunner, gen: torch.Generator | None, timer: Clock) -> None:
        """One round for every decoding row of ``batch``: extend each ``row.out``, commit the
        new tokens' K/V in the cache and set ``row.reason`` once a row is done."""

    def generate(self, model: Transformer, prompts: list[list[int]],
                 config: GenerationConfig) -> list[GenerationResult]:
        """Generate for every prompt, ``max_num_seqs`` at a time; results in input order."""
        capacity = max((row_capacity(len(p), max(1, config.max_new_tokens)) for p in prompts),
                       default=1)
        rows = self.max_num_seqs or min(max(1, len(prompts)), max_num_seqs_for(model, capacity))
        scheduler = Scheduler(self, model, config, rows, capacity)
        return scheduler.run(prompts)
