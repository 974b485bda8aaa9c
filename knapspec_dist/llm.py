"""Single-process generation: load a model and tokenizer, turn text into prompts, run a strategy."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from knapspec_dist.model.embedded import resolve_model_path
from knapspec_dist.errors import UserError
from knapspec_dist.model.weights import load_model, load_tokenizer, resolve_device, resolve_dtype
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.spec.factory import StrategyOptions, build_strategy
from knapspec_dist.engine.strategy import GenerationConfig, GenerationResult

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


def encode(tokenizer, text: str, chat: bool = False) -> list[int]:
    """Prompt text -> token ids; ``chat`` wraps it as a user message in the chat template."""
    if text is None or not text.strip():
        raise UserError("prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("--chat: the model's tokenizer has no chat template")
        # verbose=False: the context-window check is ours (check_prompt), with one clear
        # error line; transformers' "sequence length is longer" warning would add a second.
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True,
                                            tokenizer_kwargs={"verbose": False})
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"]


def generate_texts(loaded: LoadedModel, prompts: list[list[int]], options: StrategyOptions,
                   config: GenerationConfig, max_num_seqs: int | None = None
                   ) -> list[GenerationResult]:
    """Every prompt, ``max_num_seqs`` decoding at once (None: all together)."""
    strategy = build_strategy(options, loaded.model)
    strategy.max_num_seqs = max_num_seqs
    results = strategy.generate(loaded.model, prompts, config)
    for r in results:
        r.text = loaded.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    return results
