"""Plain autoregressive decoding, batched: the reference every other strategy must reproduce."""

from __future__ import annotations

import torch

from knapspec_dist.clock import Clock
from knapspec_dist.engine.generation import GenerationConfig, finish
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.sampling import choose
from knapspec_dist.engine.sequence import Batch
from knapspec_dist.engine.strategy import Strategy
from knapspec_dist.model.decoder import Transformer


class Autoregressive(Strategy):
    name = "ar"

    @torch.inference_mode()
    def round(self, model: Transformer, batch: Batch, config: GenerationConfig,
              forward: ModelRunner, timer: Clock) -> None:
        start = timer.mark()
        rows, cache = batch.rows, batch.cache
        lengths = batch.lengths
        inputs = batch.inputs(model.device)  # the one upload
        logits = forward(inputs.pending, lengths, cache, slice(0, len(rows)),
                         starts_dev=inputs.starts)
        nxt = choose(logits[:, 0], config.sampling, inputs.seeds,
                     inputs.index).tolist()  # the one read-back
        end = timer.mark()
        timer.sync()  # after the read-back: free
        elapsed = timer.seconds(start, end)
        for b, row in enumerate(rows):
            cache.commit(b, lengths[b] + 1)
            row.out, row.reason = finish(row.out + [nxt[b]], row.limit, model, config)
            row.stats.verify_s += elapsed
