"""Single-process generation: load a model and tokenizer, turn text into prompts, run a strategy."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from knapspec_dist.engine.generation import GenerationConfig, GenerationResult
from knapspec_dist.engine.scheduler import generate
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
                   config: GenerationConfig, max_num_seqs: int | None = None
                   ) -> list[GenerationResult]:
    """Every prompt, ``max_num_seqs`` decoding at once (None: all together)."""
    strategy = build_strategy(options, loaded.model)
    results = generate(strategy, loaded.model, prompts, config, max_num_seqs=max_num_seqs)
    for r in results:
        r.text = loaded.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    return results
