"""Turn input rows into prompt token ids, row by row; a bad row gets an error, not an exception.

Text mode (``--text-column``): the prompt is the model's chat template around one user
message, ``instruction + "\\n\\n" + document``, with the generation prompt added.  Prompt
mode (``--prompt-column``): the text is tokenized as is (with the tokenizer's special
tokens, e.g. BOS).

A row fits when ``prompt tokens + max_new_tokens <= max_model_len`` (the model's context
window unless ``--max-model-len`` lowers it).  Otherwise, without ``--truncate`` the row
fails; with it the end of the document (prompt mode: of the prompt) is cut so that the row
fits, and the row is marked ``truncated``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from knapspec_dist.errors import UserError
from knapspec_dist.model.tokenizer import encode, has_chat_template

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    """One row ready to generate, or its error."""

    index: int  # position in the input
    id: object
    ids: list[int] | None  # prompt token ids; None when the row failed
    num_input_tokens: int | None = None
    truncated: bool = False
    error: str | None = None


class PromptBuilder:
    def __init__(self, tokenizer, mode: str, instruction: str, max_model_len: int,
                 max_new_tokens: int, truncate: bool, column: str):
        self.tokenizer = tokenizer
        self.mode = mode
        self.instruction = instruction
        self.max_model_len = max_model_len
        self.max_new_tokens = max_new_tokens
        self.truncate = truncate
        self.column = column
        if mode == "text" and not has_chat_template(tokenizer):
            raise UserError("--text-column needs a model whose tokenizer has a chat template; "
                            "use --prompt-column with ready-made prompts instead")

    @property
    def limit(self) -> int:
        """Most prompt tokens a row may have."""
        return self.max_model_len - self.max_new_tokens

    def _message(self, text: str) -> str:
        return f"{self.instruction}\n\n{text}" if self.instruction else text

    def encode(self, text: str) -> list[int]:
        if self.mode == "prompt":
            return encode(self.tokenizer, text)
        return encode(self.tokenizer, self._message(text), chat=True)

    def build(self, index: int, row_id, text) -> Prompt:
        if text is None:
            return Prompt(index, row_id, None, error=f"{self.column!r} is null")
        if isinstance(text, bytes):  # jobs/inputs.py keeps a value that is not UTF-8 as bytes
            return Prompt(index, row_id, None, error=utf8_error(self.column, text))
        if not isinstance(text, str) or not text.strip():
            return Prompt(index, row_id, None, error=f"{self.column!r} is empty")
        ids = self.encode(text)
        if len(ids) <= self.limit:
            return Prompt(index, row_id, ids, len(ids))
        if not self.truncate:
            return Prompt(index, row_id, None, len(ids), error=(
                f"prompt has {len(ids)} tokens; with --max-new-tokens {self.max_new_tokens} it "
                f"needs {len(ids) + self.max_new_tokens} > the context window of "
                f"{self.max_model_len} tokens (pass --truncate to cut long documents)"))
        cut = self._truncate(text, len(ids))
        if cut is None:
            return Prompt(index, row_id, None, len(ids), error=(
                f"prompt has {len(ids)} tokens and cannot be cut to fit {self.limit} "
                f"(context window {self.max_model_len} - --max-new-tokens {self.max_new_tokens})"))
        return Prompt(index, row_id, cut, len(cut), truncated=True)

    def _truncate(self, text: str, full: int) -> list[int] | None:
        """Prompt ids with the end of ``text`` dropped so that it fits, or None if it cannot."""
        pieces = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        overhead = full - len(pieces)  # template (or BOS) tokens around the text
        keep = self.limit - overhead
        for _ in range(8):  # re-tokenizing a cut text can merge or split a few tokens
            if keep <= 0:
                return None
            ids = self.encode(self.tokenizer.decode(pieces[:keep]))
            if len(ids) <= self.limit:
                return ids
            keep -= max(len(ids) - self.limit, 1)
        return None


def utf8_error(column: str, raw: bytes) -> str:
    """The row error of a value that is not valid UTF-8: where the first bad byte is."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = raw[e.start:e.end]
        return (f"{column!r} is not valid UTF-8: {e.reason} (byte 0x{bad[:1].hex()} at offset "
                f"{e.start} of {len(raw)}); re-encode the text column as UTF-8")
    return f"{column!r} is not valid UTF-8"


def choose_baseline(prompts: list[Prompt], fraction: float) -> set:
    """Ids of the rows also run with ``ar``: spread evenly over prompt lengths.

    ``ceil(fraction * valid rows)`` rows (at least one when ``fraction > 0``) of the rows
    that have a prompt, picked at even steps through them sorted by length (ties by id), so
    the shortest and longest are in when two or more are picked, and the median length
    when one is.  Deterministic: a resumed job picks the same rows.
    """
    valid = sorted((p for p in prompts if p.ids is not None),
                   key=lambda p: (p.num_input_tokens, str(p.id)))
    if fraction <= 0 or not valid:
        return set()
    k = min(len(valid), max(1, math.ceil(fraction * len(valid) - 1e-9)))
    if k == 1:
        return {valid[(len(valid) - 1) // 2].id}
    return {valid[round(i * (len(valid) - 1) / (k - 1))].id for i in range(k)}
