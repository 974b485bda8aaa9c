"""The tokenizer of a model folder, and text -> prompt ids: the one place both happen.

``encode`` with ``chat`` wraps the text as one user message in the model's chat template,
with the generation prompt added; without it the text is tokenized as is (with the
tokenizer's special tokens, e.g. BOS). The context-window check is the engine's
(``check_prompt``), with one clear error line, so transformers' own length warning is off.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from knapspec_dist.errors import UserError


def load_tokenizer(model_dir: str | Path):
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise UserError(f"{model_dir}: cannot load tokenizer ({e})") from None


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer, text: str, chat: bool = False) -> list[int]:
    """Prompt text -> token ids; ``chat`` wraps it as a user message in the chat template."""
    if text is None or not text.strip():
        raise UserError("prompt is empty")
    if chat:
        if not has_chat_template(tokenizer):
            raise UserError("--chat: the model's tokenizer has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True,
                                            tokenizer_kwargs={"verbose": False})
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
