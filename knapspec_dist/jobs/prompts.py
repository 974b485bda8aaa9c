"""Turn input rows into prompt token ids, row by row; a bad row gets an error, not an exception.

:class:`TokenizeStage` does it batch by batch, where Ray Data runs it (on the cluster's CPUs).

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

import pyarrow as pa
import pyarrow.compute as pc

from knapspec_dist.errors import UserError
from knapspec_dist.jobs.inputs import normalize, texts_of
from knapspec_dist.model.tokenizer import encode, has_chat_template, load_tokenizer
from knapspec_dist.runtime.setup import check_setup

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


#: Columns of the tokenize stage's output: one row per input row, its prompt or its error.
PROMPT_COLUMNS = ("prompt_ids", "num_input_tokens", "truncated", "error")


class TokenizeStage:
    """Input batches (id, text) to prompt batches (id + :data:`PROMPT_COLUMNS`): the CPU
    stage of a job, run by Ray Data on the cluster's CPUs (runtime/stream.py) or in this
    process (tests' fake tokenizer).

    ``make_builder()`` gives the :class:`PromptBuilder` (called once per worker: it loads
    the tokenizer). Rows whose id is in ``skip`` (resume: written already) are dropped before
    they are tokenized, and when ``keep`` is given only its ids stay (the baseline passes).
    """

    def __init__(self, make_builder, id_column: str, text_column: str,
                 skip: pa.Array | None = None, keep: pa.Array | None = None):
        self.builder = make_builder()
        self.id_column, self.text_column = id_column, text_column
        self.skip, self.keep = skip, keep

    def __call__(self, table: pa.Table) -> pa.Table:
        table = normalize(table, self.id_column, self.text_column)
        ids = table.column(0)
        if self.skip is not None and len(self.skip):
            table = table.filter(pc.invert(pc.is_in(ids, value_set=self.skip)))
        if self.keep is not None:
            table = table.filter(pc.is_in(table.column(0), value_set=self.keep))
        row_ids = table.column(0).to_pylist()
        prompts = [self.builder.build(i, row_id, text) for i, (row_id, text)
                   in enumerate(zip(row_ids, texts_of(table.column(1))))]
        return pa.table({
            self.id_column: table.column(0),
            "prompt_ids": pa.array([p.ids for p in prompts], pa.list_(pa.int32())),
            "num_input_tokens": pa.array([p.num_input_tokens for p in prompts], pa.int64()),
            "truncated": pa.array([p.truncated for p in prompts], pa.bool_()),
            "error": pa.array([p.error for p in prompts], pa.string())})


def load_text_tools(config):
    """Tokenizer and context window of the model, from its folder (no weights are read),
    once runtime's :func:`check_setup` passed: a bad model, tp or strategy option fails
    before thousands of documents are tokenized and before any row is written."""
    path, model_config = check_setup(config.model, config.tp, config.strategy)
    return load_tokenizer(path), model_config.max_position_embeddings


def make_builder(tools, config, max_len: int) -> PromptBuilder:
    """The job's PromptBuilder from ``tools(config)`` (its tokenizer) and its context limit."""
    tokenizer, _ = tools(config)
    return PromptBuilder(tokenizer, config.mode, config.instruction, max_len,
                         config.max_new_tokens, config.truncate, config.input_column)


def choose_baseline(rows, fraction: float) -> set:
    """Ids of the rows also run with ``ar``: spread evenly over prompt lengths.

    ``rows``: ``(id, num_input_tokens)`` of the rows that have a prompt (the job reads them
    from its output once the main pass is complete, two small columns: no prompt is held
    for this).  ``ceil(fraction * rows)`` rows (at least one when ``fraction > 0``), picked
    at even steps through them sorted by length (ties by id), so the shortest and longest
    are in when two or more are picked, and the median length when one is.  Deterministic:
    a resumed job picks the same rows.
    """
    valid = sorted(rows, key=lambda r: (r[1], str(r[0])))
    if fraction <= 0 or not valid:
        return set()
    k = min(len(valid), max(1, math.ceil(fraction * len(valid) - 1e-9)))
    if k == 1:
        return {valid[(len(valid) - 1) // 2][0]}
    return {valid[round(i * (len(valid) - 1) / (k - 1))][0] for i in range(k)}
