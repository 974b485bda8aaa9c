"""One interface for every generation strategy: a round of decoding over a batch of rows.

Strategies work on token ids; the caller turns text into ids and back. In the spirit of
LayerSkip's generation strategies, autoregressive and self-speculative decoding are
interchangeable, so one benchmark runs them side by side on the same prompts. A strategy says
what one round does to every decoding row (``round``); the scheduler (scheduler.py), which
owns the model runner and its KV cache, admits rows, prefills them and retires them around
it, so every strategy is continuously batched the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from knapspec_dist.clock import Clock
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.sequence import Batch
from knapspec_dist.model.decoder import Transformer


class Strategy(ABC):
    name: str

    def start(self, model: Transformer) -> None:
        """A batch run begins (selectors reset their schedule)."""

    def admitted(self, rid: int) -> None:
        """Row ``rid`` starts decoding."""

    def retired(self, rid: int) -> None:
        """Row ``rid`` is done."""

    @abstractmethod
    def round(self, model: Transformer, batch: Batch, config: GenerationConfig,
              forward: ModelRunner, timer: Clock) -> None:
        """One round for every decoding row of ``batch``: extend each ``row.out``, commit the
        new tokens' K/V in the cache and set ``row.reason`` once a row is done."""
