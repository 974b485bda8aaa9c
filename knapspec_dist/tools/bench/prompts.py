"""Long-document prompts: the same K documents of the bundled corpus, cut to each context."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from knapspec_dist.errors import UserError
from knapspec_dist.model.embedded import resolve_model_path
from knapspec_dist.model.tokenizer import encode, load_tokenizer
from knapspec_dist.tools.corpus import AUSTEN_BOOKS, document_of_tokens

log = logging.getLogger(__name__)

SUMMARIZE = "Summarize this text in a few sentences.\n\n"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ByteTokenizer:
    """UTF-8 bytes as token ids, for checkpoints without a tokenizer (the random test models)."""

    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="ignore")

    def ids(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in self.encode(text)]


def resolve_tokenizer(name: str | None, model_path: Path, vocab_size: int):
    """``--tokenizer``: 'bytes', a folder or embedded name, or (None) the model's own; UTF-8
    bytes where the model has none."""
    if name == "bytes":
        return ByteTokenizer(vocab_size)
    if name is None:
        if not any((model_path / f).is_file() for f in TOKENIZER_FILES):
            log.warning("%s has no tokenizer: prompts are UTF-8 bytes as token ids", model_path)
            return ByteTokenizer(vocab_size)
        path = model_path
    else:
        path = resolve_model_path(name)
        if not path.exists():
            raise UserError(f"tokenizer path {str(path)!r} does not exist")
    tok = load_tokenizer(path)
    if len(tok) > vocab_size:
        raise UserError(f"tokenizer {str(path)!r} has {len(tok)} tokens; the model only "
                        f"{vocab_size}")
    return tok


@dataclass
class Prompt:
    id: str  # e.g. "emma-ch01": book and first chapter of the document
    context: int  # the context length asked for
    ids: list[int]


def _wrap(tokenizer, text: str, style: str) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.ids(text)
    if style == "summarize" and getattr(tokenizer, "chat_template", None):
        return encode(tokenizer, SUMMARIZE + text, chat=True)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def build_prompts(tokenizer, contexts: list[int], count: int, window: int, new_tokens: int,
                  style: str) -> dict[int, list[Prompt]]:
    longest = window - new_tokens - 1
    if longest < 2:
        raise UserError(f"--new-tokens {new_tokens} leaves no room for a prompt in the "
                        f"model's {window}-token window")
    overhead = len(_wrap(tokenizer, "x", style)) - 1  # template tokens around the document
    out: dict[int, list[Prompt]] = {}
    for n in contexts:
        target = n
        if n > longest:
            log.warning("context %d + %d new tokens exceed the %d-token window: prompts of %d "
                        "tokens", n, new_tokens, window, longest)
            target = longest
        if target - overhead < 1:
            raise UserError(f"context {n} is too short for the prompt template "
                            f"({overhead} tokens)")
        out[n] = []
        for j in range(count):
            book, chapter = AUSTEN_BOOKS[j % len(AUSTEN_BOOKS)], 7 * (j // len(AUSTEN_BOOKS))
            size = target - overhead
            for _ in range(4):  # BPE may merge differently inside the template: trim and retry
                ids = _wrap(tokenizer, document_of_tokens(tokenizer, size, book, chapter), style)
                if len(ids) <= target or size <= 1:
                    break
                size = max(1, size - (len(ids) - target))
            if len(ids) > target:
                raise UserError(f"cannot build a prompt of {target} tokens")  # pragma: no cover
            out[n].append(Prompt(f"{book}-ch{chapter + 1:02d}", n, ids))
            log.info("context %d, prompt %s: %d tokens", n, out[n][-1].id, len(ids))
    return out
