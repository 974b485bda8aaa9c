"""Single-process generation: load a model and tokenizer, turn text into prompts, run a strategy."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from knapspec_dist.engine.generation import GenerationConfig, GenerationResult
from knapspec_dist.engine.memory import MEMORY_UTILIZATION, kv_source, plan_for
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.errors import UserError
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.model.embedded import resolve_model_path
from knapspec_dist.model.tokenizer import load_tokenizer
from knapspec_dist.model.weights import load_model, resolve_device, resolve_dtype
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.speculation.options import StrategyOptions

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object
    path: str


def load(model: str, dtype: str = "fp32", device: str = "cpu") -> LoadedModel:
    path = resolve_model_path(model)
    if not path.exists():
        raise UserError(f"model path {str(path)!r} does not exist")
    m = load_model(path, dtype=resolve_dtype(dtype), device=resolve_device(device))
    return LoadedModel(m, load_tokenizer(path), str(path))


def generate_texts(loaded: LoadedModel, prompts: list[list[int]], options: StrategyOptions,
                   config: GenerationConfig, max_num_seqs: int | None = None, *,
                   kv_cache_memory: int | None = None,
                   memory_utilization: float = MEMORY_UTILIZATION) -> list[GenerationResult]:
    """Every prompt, continuously batched over a paged KV cache sized as a replica's is
    (engine/memory.py): ``kv_cache_memory`` bytes, else ``memory_utilization`` of the free
    memory; at most ``max_num_seqs`` rows at once (default 256 on a GPU, 16 on a CPU). A
    prompt the empty cache cannot hold is refused before any is generated."""
    model = loaded.model
    needs = [row_capacity(len(p), max(1, config.max_new_tokens)) for p in prompts]
    kv = plan_for(model, max(needs, default=1), paged=True, kv_cache_memory=kv_cache_memory,
                  memory_utilization=memory_utilization, max_num_seqs=max_num_seqs)
    source = kv_source(kv_cache_memory, memory_utilization, "the free memory")
    for i, need in enumerate(needs):
        if not kv.holds(need):
            raise UserError(f"prompt {i}: {len(prompts[i])} tokens with "
                            f"{config.max_new_tokens} new tokens need {need} cache positions; "
                            f"the KV cache holds {kv.tokens} ({source}): give more "
                            "--kv-cache-memory or fewer --max-new-tokens")
    strategy = build_strategy(options, model)
    results = generate(strategy, model, prompts, config,
                       max_num_seqs=max(1, min(kv.max_num_seqs, len(prompts))),
                       paging=kv.paging())
    for r in results:
        r.text = loaded.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    return results
