"""Plain autoregressive decoding, batched: the reference every other strategy must reproduce."""

from __future__ import annotations

import torch

from ..cache import KVCache, kv_heads
from ..model import Capture, Transformer
from ..sampling import choose
from .strategy import (GenerationConfig, GenerationResult, GenerationStats, Strategy, Timer,
                       check_prompt, finish)


def prefill(model: Transformer, cache: KVCache, row: int, prompt: list[int],
            capture: Capture | None = None) -> torch.Tensor:
    """Run one prompt into its cache row (padding-free); return its last-position logits [V]."""
    tokens = torch.tensor([prompt], device=model.device)
    rows = slice(row, row + 1)
    logits = model(tokens, cache.positions(rows, len(prompt), model.device), cache, rows,
                   last_only=True, capture=capture)
    cache.commit(row, len(prompt))
    return logits[0, -1]


class Autoregressive(Strategy):
    name = "ar"

    @torch.inference_mode()
    def generate(self, model: Transformer, prompts: list[list[int]],
                 config: GenerationConfig) -> list[GenerationResult]:
        limits = [check_prompt(model, p, config) for p in prompts]
        timer = Timer(model.device)
        start = timer.now()
        batch = len(prompts)
        cache = KVCache(model.cfg, batch, max(map(len, prompts)) + max(limits) + 1,
                        dtype=model.dtype, device=model.device,
                        kv_heads=kv_heads(model))
        gen = config.sampling.generator()
        first = torch.stack([prefill(model, cache, b, p) for b, p in enumerate(prompts)])
        outputs = [[t] for t in choose(first, config.sampling, gen).tolist()]
        prefill_s = timer.now() - start
        reasons: list[str | None] = [None] * batch
        steps = 0
        for b in range(batch):
            outputs[b], reasons[b] = finish(outputs[b], limits[b], model, config)
        everyone = slice(0, batch)
        while None in reasons:
            tokens = torch.tensor([[out[-1]] for out in outputs], device=model.device)
            logits = model(tokens, cache.positions(everyone, 1, model.device), cache, everyone)
            nxt = choose(logits[:, 0], config.sampling, gen).tolist()
            steps += 1
            for b in range(batch):
                if reasons[b] is None:  # finished rows stay put, rewriting one slot
                    cache.commit(b, cache.lengths[b] + 1)
                    outputs[b], reasons[b] = finish(outputs[b] + [nxt[b]], limits[b], model, config)
        wall = timer.now() - start
        return [GenerationResult(out, GenerationStats(
            prompt_tokens=len(p), new_tokens=len(out), steps=steps, wall_s=wall,
            prefill_s=prefill_s, verify_s=wall - prefill_s), reason)
            for p, out, reason in zip(prompts, outputs, reasons)]
