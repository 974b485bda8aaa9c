"""Turn rows into prompt token ids, row by row; a bad row gets an error, not an exception.

:class:`TokenizeStage` does it batch by batch: the one chat-template-and-tokenize stage of
both the Ray Data processor (runtime/processor.py) and the batch job (jobs/), run by Ray
Data on the cluster's CPUs or, for a small job, in the driver (runtime/stages.py).

Messages mode (the processor's ``messages`` column, ``ray.data.llm``'s convention): the
chat template around the row's messages, with the generation prompt added.

Text mode (``--text-column``): the prompt is the model's chat template around one user
message, ``instruction + "\\n\\n" + document`` (or the instruction with ``{document}``
replaced by the document, where it names that place), with the generation prompt added.  Prompt
mode (``--prompt-column``): the text is tokenized as is (with the tokenizer's special
tokens, e.g. BOS).

A row fits when ``prompt tokens + max_new_tokens <= max_model_len`` (the model's context
window unless ``--max-model-len`` lowers it).  Otherwise, in text mode with a
:class:`TreeShape` (a job's default, ``--long-documents tree``), the document is cut into
chunks (runtime/chunking.py) whose prompts the row carries instead of one prompt, for a tree
of summaries (runtime/tree.py); a tree's shape that no long row could take
(:func:`tree_chunk_tokens`) is refused when the builder is made, before any row; with
``truncate`` the end of the document (prompt mode: of the prompt; messages mode: of the last
message) is cut so that the row fits, and the row is marked ``truncated``; else the row
fails.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.compute as pc

from knapspec_dist.errors import UserError
from knapspec_dist.model.tokenizer import encode, has_chat_template, load_tokenizer
from knapspec_dist.runtime.chunking import chunk_document, text_digest
from knapspec_dist.runtime.setup import check_setup
from knapspec_dist.runtime.tree import SEPARATOR

log = logging.getLogger(__name__)

#: A text row's instruction (the batch job's --instruction).
DEFAULT_INSTRUCTION = "Summarize the following document in a few sentences."
#: In an instruction, where the document goes (else the document follows the instruction).
DOCUMENT = "{document}"

#: A chunk's prompt; ``{part}`` and ``{parts}`` say which part of how many it is, and
#: ``{document}`` where the chunk goes (else it follows). After the text, as the demo's
#: instruction: SmolLM2-135M's summaries loop less so (docs/sampling.md#the-demos-settings).
CHUNK_INSTRUCTION = ("{document}\n\nSummarize the text above (part {part} of {parts} of a "
                     "longer document) in a few sentences.")
#: A group's prompt: its summaries in order, a blank line between them, go to ``{document}``.
#: Plain wording: SmolLM2-135M echoed "The text is a continuation of a longer document" to a
#: longer one (docs/long-documents.md).
COMBINE_INSTRUCTION = ("{document}\n\nThe text above is made of summaries of consecutive "
                       "parts of one document, in order. Summarize it in a few sentences.")


#: The default chunk, where the window holds it: BooookScore's smaller chunk, and the best of
#: 2,048, 3,072 and 3,995 tokens in a measurement of SmolLM2 summarizing whole novels into
#: 128-token chunk summaries (each chunk's own main characters named by its summary: 0.32,
#: 0.29, 0.22 of them; docs/long-documents.md), with the fastest tree of the three. A chunk is
#: compressed into ``--max-new-tokens``: its size goes with that, not with the window (a 128k
#: window's half would squeeze 63k tokens into one summary).
DEFAULT_CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class TreeShape:
    """How a text row longer than the window becomes a tree of summaries (runtime/tree.py).

    ``chunk_tokens``: a chunk's document tokens; None: ``DEFAULT_CHUNK_TOKENS``, or half of
    what a chunk's prompt leaves after its template and the summary's tokens where that is
    less.
    ``overlap``: tokens of the previous chunk's end repeated at a chunk's start.
    ``max_depth``: the most levels a tree may have, its chunks' level included.
    ``max_fan_in``: the most summaries one group combines; None: as many as fit the window."""

    chunk_tokens: int | None = None
    overlap: int = 0
    max_depth: int = 8
    chunk_instruction: str = CHUNK_INSTRUCTION
    combine_instruction: str = COMBINE_INSTRUCTION
    max_fan_in: int | None = None

    def fingerprint(self) -> dict:
        """What a job's identity keeps of the shape: every field, the fan-in only when
        bounded (as before it could be, so earlier outputs resume)."""
        shape = asdict(self)
        if self.max_fan_in is None:
            del shape["max_fan_in"]
        return shape


#: Prompt tokens a chunk keeps free beyond its template and text: re-tokenizing a cut text
#: can merge or split a few tokens.
CHUNK_SLACK = 8


def check_tree_shape(tree: TreeShape) -> None:
    """What the model does not decide: an overlap shorter than the chunk it repeats into
    (the given one, else at most ``DEFAULT_CHUNK_TOKENS``), refused as options are parsed."""
    if tree.chunk_tokens is not None and tree.overlap >= tree.chunk_tokens:
        raise UserError(f"--chunk-overlap {tree.overlap} must be less than --chunk-tokens "
                        f"{tree.chunk_tokens}")
    if tree.chunk_tokens is None and tree.overlap >= DEFAULT_CHUNK_TOKENS:
        raise UserError(f"--chunk-overlap {tree.overlap} must be less than the chunk it is "
                        f"part of: --chunk-tokens, {DEFAULT_CHUNK_TOKENS} by default (less "
                        "where the window is small)")


def tree_chunk_tokens(tree: TreeShape, max_model_len: int, max_new_tokens: int,
                      chunk_template: int, combine_template: int) -> int:
    """A tree's chunk in document tokens: ``tree.chunk_tokens``, else ``DEFAULT_CHUNK_TOKENS``
    or half of what a chunk's prompt leaves, the smaller. Or one UserError line naming the
    options and values that leave a row past the window no tree, whatever its text: a chunk
    (with its overlap) past what its prompt leaves, an overlap not shorter than the chunk, a
    combining prompt without room for two summaries of ``max_new_tokens``. Pure (the
    templates' token counts are the caller's), so the job and the processor refuse such
    options before anything runs instead of failing every long row.

    ``chunk_template`` / ``combine_template``: the tokens of a chunk's / a group's prompt
    with no text in it."""
    check_tree_shape(tree)
    limit = max_model_len - max_new_tokens
    window = f"--max-model-len {max_model_len} - --max-new-tokens {max_new_tokens}"
    if combine_template + 2 * (max_new_tokens + SEPARATOR) > limit:
        raise UserError(
            f"--max-new-tokens {max_new_tokens}: a tree combines summaries of up to that many "
            f"tokens, and two of them with the combining prompt's {combine_template} template "
            f"tokens do not fit the {limit} prompt tokens left ({window}); lower "
            "--max-new-tokens, raise --max-model-len, or choose --long-documents truncate or "
            "fail")
    text = limit - chunk_template - CHUNK_SLACK  # a chunk's text and its overlap
    room = text - tree.overlap
    if tree.chunk_tokens is None:
        chunk = min(DEFAULT_CHUNK_TOKENS, room // 2)
        if tree.overlap and tree.overlap >= chunk:
            raise UserError(
                f"--chunk-overlap {tree.overlap} must be less than the chunk it is part of, "
                f"and the default --chunk-tokens is {max(chunk, 0)} here: the smaller of "
                f"{DEFAULT_CHUNK_TOKENS} and half of the {max(room, 0)} text tokens a chunk's "
                f"prompt leaves beside the overlap ({window} - {chunk_template} template and "
                f"{CHUNK_SLACK} slack tokens - the overlap); lower --chunk-overlap, or raise "
                "--max-model-len or lower --max-new-tokens")
        if chunk < 1:
            raise UserError(
                f"a chunk's prompt holds no text: {window} leaves {limit} prompt tokens, and "
                f"its template takes {chunk_template} + {CHUNK_SLACK} slack; raise "
                "--max-model-len, lower --max-new-tokens, or choose --long-documents "
                "truncate or fail")
        return chunk
    if tree.chunk_tokens > room:
        raise UserError(
            f"--chunk-tokens {tree.chunk_tokens} + --chunk-overlap {tree.overlap} do not fit "
            f"the {max(text, 0)} text tokens a chunk's prompt holds ({window} - "
            f"{chunk_template} template and {CHUNK_SLACK} slack tokens); "
            + (f"--chunk-tokens {room} at most" if room >= 1 else
               "raise --max-model-len or lower --max-new-tokens"))
    return tree.chunk_tokens


@dataclass
class Prompt:
    """One row ready to generate, or its error."""

    index: int  # position in the input
    id: object
    ids: list[int] | None  # prompt token ids; None when the row failed
    num_input_tokens: int | None = None
    truncated: bool = False
    error: str | None = None
    chunks: list[tuple[list[int], str]] | None = None  # a tree's: (prompt ids, text digest)


class PromptBuilder:
    def __init__(self, tokenizer, mode: str, instruction: str, max_model_len: int,
                 max_new_tokens: int, truncate: bool, column: str,
                 tree: TreeShape | None = None):
        self.tokenizer = tokenizer
        self.tree = tree if mode == "text" else None
        self.mode = mode
        self.instruction = instruction
        self.max_model_len = max_model_len
        self.max_new_tokens = max_new_tokens
        self.truncate = truncate
        self.column = column
        if mode in ("text", "messages") and not has_chat_template(tokenizer):
            raise UserError(f"{'--text-column' if mode == 'text' else 'messages'} needs a "
                            "model whose tokenizer has a chat template; use "
                            f"{'--prompt-column' if mode == 'text' else 'a prompt column'} "
                            "with ready-made prompts instead")
        if self.tree is not None:  # a shape no long row could take: refused here, at once
            self.chunk_tokens = tree_chunk_tokens(
                self.tree, max_model_len, max_new_tokens,
                len(self.chunk_prompt("", 10 ** 6, 10 ** 6)), len(self.combine_prompt([], 1, 0)))

    def chunk_prompt(self, text: str, part: int, parts: int) -> list[int]:
        """The prompt ids of a document's chunk ``part`` (from 1) of ``parts``."""
        instruction = self.tree.chunk_instruction.replace("{part}", str(part)).replace(
            "{parts}", str(parts))
        return encode(self.tokenizer, _place(instruction, text), chat=True)

    def combine_prompt(self, summaries: list[str], level: int, index: int) -> list[int]:
        """The prompt ids that combine ``summaries`` (in order) into one, at ``level``."""
        body = "\n\n".join(s.strip() for s in summaries)
        return encode(self.tokenizer, _place(self.tree.combine_instruction, body), chat=True)
    @property
    def limit(self) -> int:
        """Most prompt tokens a row may have."""
        return self.max_model_len - self.max_new_tokens

    def _message(self, text: str) -> str:
        return _place(self.instruction, text)

    def encode(self, value) -> list[int]:
        """A row's value (text, prompt or messages) as prompt token ids."""
        if self.mode == "prompt":
            return encode(self.tokenizer, value)
        if self.mode == "text":
            return encode(self.tokenizer, self._message(value), chat=True)
        ids = self.tokenizer.apply_chat_template(list(value), add_generation_prompt=True,
                                                 tokenize=True,
                                                 tokenizer_kwargs={"verbose": False})
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _document(self, value) -> str:
        """The part of a row's value that truncation cuts."""
        return value[-1]["content"] if self.mode == "messages" else value

    def _with_document(self, value, text: str):
        if self.mode == "messages":
            return [*value[:-1], {**value[-1], "content": text}]
        return text

    def build(self, index: int, row_id, text) -> Prompt:
        if text is None:
            return Prompt(index, row_id, None, error=f"{self.column!r} is null")
        if isinstance(text, bytes):  # a value that is not UTF-8 is kept as bytes (texts_of)
            return Prompt(index, row_id, None, error=utf8_error(self.column, text))
        if self.mode == "messages":
            if not isinstance(text, (list, tuple)) or not text or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in text):
                return Prompt(index, row_id, None, error=f"{self.column!r} is empty or not "
                              "a list of {role, content} messages")
        elif not isinstance(text, str) or not text.strip():
            return Prompt(index, row_id, None, error=f"{self.column!r} is empty")
        ids = self.encode(text)
        if len(ids) <= self.limit:
            return Prompt(index, row_id, ids, len(ids))
        if self.tree is not None:
            return self._chunks(index, row_id, text, len(ids))
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

    def _chunks(self, index: int, row_id, text: str, full: int) -> Prompt:
        """A document past the window as its chunks' prompts, or the row's error."""
        pieces = chunk_document(text, self.tokenizer, self.chunk_tokens, self.tree.overlap)
        chunks = []
        for piece in pieces:
            ids = self.chunk_prompt(piece.text, piece.index + 1, len(pieces))
            if len(ids) > self.limit:  # a cut text re-tokenized longer than the slack
                return Prompt(index, row_id, None, full, error=(
                    f"chunk {piece.index + 1} of {len(pieces)} has a prompt of {len(ids)} "
                    f"tokens > {self.limit}; lower --chunk-tokens"))
            chunks.append((ids, text_digest([piece.text])))
        return Prompt(index, row_id, None, full, chunks=chunks)

    def _truncate(self, text, full: int) -> list[int] | None:
        """Prompt ids with the end of ``text``'s document dropped so that it fits, or None if
        it cannot."""
        pieces = self.tokenizer(self._document(text), add_special_tokens=False,
                                verbose=False)["input_ids"]
        overhead = full - len(pieces)  # template (or BOS) tokens around the text
        keep = self.limit - overhead
        for _ in range(8):  # re-tokenizing a cut text can merge or split a few tokens
            if keep <= 0:
                return None
            ids = self.encode(self._with_document(text, self.tokenizer.decode(pieces[:keep])))
            if len(ids) <= self.limit:
                return ids
            keep -= max(len(ids) - self.limit, 1)
        return None


def _place(instruction: str, text: str) -> str:
    """``text`` where ``instruction`` says ``{document}`` (replace: a document's own braces
    stay as they are), else after it."""
    if DOCUMENT in instruction:
        return instruction.replace(DOCUMENT, text)
    return f"{instruction}\n\n{text}" if instruction else text


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
#: ... and, where its builder makes trees, a long row's chunks (null for the other rows).
CHUNK_COLUMNS = ("chunk_prompts", "chunk_digests")


class TokenizeStage:
    """Row batches to prompt batches: the chat template and tokenizer over ``text_column``
    (:class:`PromptBuilder`), one row out per row in, with :data:`PROMPT_COLUMNS` added.

    ``make_builder()`` gives the :class:`PromptBuilder` (called once per worker: it loads
    the tokenizer). With an ``id_column`` (a job) only the id is carried, so the driver never
    holds a text; rows whose id is in ``skip`` (resume: written already) are dropped before
    they are tokenized, and when ``keep`` is given only its ids stay (the baseline passes).
    Without one (the processor) every column but ``text_column`` is carried, as
    ``ray.data.llm`` carries a user's columns.
    """

    def __init__(self, make_builder, text_column: str, id_column: str | None = None,
                 skip: pa.Array | None = None, keep: pa.Array | None = None):
        self.builder = make_builder()
        self.id_column, self.text_column = id_column, text_column
        self.skip, self.keep = skip, keep

    def __call__(self, table: pa.Table) -> pa.Table:
        if self.id_column is not None:
            table = normalize(table, self.id_column, self.text_column)
            ids = table.column(0)
            if self.skip is not None and len(self.skip):
                table = table.filter(pc.invert(pc.is_in(ids, value_set=self.skip)))
            if self.keep is not None:
                table = table.filter(pc.is_in(table.column(0), value_set=self.keep))
        column = table.column(self.text_column)
        values = (column.to_pylist() if self.builder.mode == "messages"
                  else texts_of(as_binary(column)))
        prompts = [self.builder.build(i, None, v) for i, v in enumerate(values)]
        out = table.drop_columns([n for n in (self.text_column, *PROMPT_COLUMNS, *CHUNK_COLUMNS)
                                  if n in table.column_names])
        for name, values in (
                ("prompt_ids", pa.array([p.ids for p in prompts], pa.list_(pa.int32()))),
                ("num_input_tokens", pa.array([p.num_input_tokens for p in prompts], pa.int64())),
                ("truncated", pa.array([p.truncated for p in prompts], pa.bool_())),
                ("error", pa.array([p.error for p in prompts], pa.string()))):
            out = out.append_column(name, values)
        if self.builder.tree is not None:
            out = out.append_column("chunk_prompts", pa.array(
                [None if p.chunks is None else [ids for ids, _ in p.chunks] for p in prompts],
                pa.list_(pa.list_(pa.int32()))))
            out = out.append_column("chunk_digests", pa.array(
                [None if p.chunks is None else [d for _, d in p.chunks] for p in prompts],
                pa.list_(pa.string())))
        return out


def load_text_tools(config):
    """Tokenizer and context window of the model, from its folder (no weights are read),
    once runtime's :func:`check_setup` passed: a bad model, tp or strategy option fails
    before thousands of documents are tokenized and before any row is written."""
    path, model_config = check_setup(config.model, config.tp, config.strategy)
    return load_tokenizer(path), model_config.max_position_embeddings


def make_builder(tools, config, mode: str, instruction: str, max_len: int | None,
                 max_new_tokens: int, truncate: bool, column: str,
                 tree: TreeShape | None = None) -> PromptBuilder:
    """A PromptBuilder from ``tools(config)`` (the tokenizer and the model's window, the
    limit when ``max_len`` is None): picklable with functools.partial, for a stage's actors."""
    tokenizer, window = tools(config)
    return PromptBuilder(tokenizer, mode, instruction, window if max_len is None else max_len,
                         max_new_tokens, truncate, column, tree)


def texts_of(column: pa.ChunkedArray) -> list:
    """The (binary, see ``_check_types``) text column as python values: str, None, or the raw
    bytes of a value that is not valid UTF-8 (that row's error, not the job's)."""
    out: list = []
    for value in column.to_pylist():
        if value is None:
            out.append(None)
            continue
        try:
            out.append(value.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(bytes(value))
    return out


def as_binary(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A string / binary column (large or not) as binary, its bytes unchecked: pyarrow does
    not validate a string column's UTF-8 on read, and a cast or ``to_pylist`` would fail the
    whole file on its first bad value; ``_texts`` decodes row by row instead."""
    views = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}
    chunks = [c.view(views[c.type]) if c.type in views else c for c in column.chunks]
    return pa.chunked_array([c.cast(pa.binary()) for c in chunks], type=pa.binary())


def check_id_type(table: pa.Table, path: str, id_column: str) -> pa.Table:
    """The id column as strings or integers (a dictionary decoded, large strings cast)."""
    id_type = table.schema.field(id_column).type
    if pa.types.is_dictionary(id_type):
        table = table.set_column(table.schema.get_field_index(id_column), id_column,
                                 table.column(id_column).cast(id_type.value_type))
        id_type = id_type.value_type
    if not (pa.types.is_integer(id_type) or pa.types.is_string(id_type)
            or pa.types.is_large_string(id_type)):
        raise UserError(f"{path}: id column {id_column!r} has type {id_type}; "
                        "expected strings or integers")
    if pa.types.is_large_string(id_type):
        table = table.set_column(table.schema.get_field_index(id_column), id_column,
                                 table.column(id_column).cast(pa.string()))
    return table


def text_value_type(text_type: pa.DataType) -> pa.DataType:
    return text_type.value_type if pa.types.is_dictionary(text_type) else text_type


def normalize(table: pa.Table, id_column: str, text_column: str) -> pa.Table:
    """One batch of (id, text) with the types the tokenize stage expects: ids as strings or
    integers, the text as binary (a null column too: row-level errors, not a file error).
    The file-level type checks ran in :func:`read_input`."""
    table = check_id_type(table.select([id_column, text_column]), "", id_column)
    text_type = text_value_type(table.schema.field(text_column).type)
    column = table.column(text_column)
    if pa.types.is_dictionary(column.type):
        column = column.cast(text_type)
    column = column.cast(pa.binary()) if pa.types.is_null(text_type) else as_binary(column)
    return table.set_column(1, text_column, column)
