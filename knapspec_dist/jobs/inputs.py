"""Read the job's input Parquet and check it as a whole, before any model is loaded.

``--input`` is a Parquet file, a directory of them (searched recursively; names starting
with ``.`` or ``_`` are skipped, as pyarrow and Spark do) or a glob (``*`` and ``?`` within
one path segment, ``**`` across segments: ``/data/**/*.parquet``), given as a local path or
a URI any pyarrow filesystem reads (``s3://``, ``gs://``, ``hdfs://``, ``file://``).

File-level problems raise :class:`~knapspec_dist.errors.UserError` with a message that
names the file and the fix: nothing found, a file that is not Parquet, a missing column, a
column of the wrong type, a null id, duplicate ids, no rows.  Row-level problems (a null or
empty text, a text that is not valid UTF-8, a prompt too long for the context window) are
not checked here: they become that row's ``error`` (see :mod:`.prompts`).

Text columns are strings, or binary columns holding UTF-8 text (decoded row by row).  A
value that is not valid UTF-8 (Parquet does not check the bytes of a string column, so such
files exist) is kept as its raw ``bytes``; :class:`~.prompts.PromptBuilder` turns it into
that row's error and the other rows run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from knapspec_dist.errors import UserError

log = logging.getLogger(__name__)

_GLOB_CHARS = set("*?[")


@dataclass
class InputRows:
    """The rows of the job: ids (unique, never null) and their text or prompt (may be null)."""

    files: list[str]
    ids: list  # python values of the id column, input order
    texts: list  # str | None, same order; bytes: a value that is not valid UTF-8
    id_type: pa.DataType

    def __len__(self) -> int:
        return len(self.ids)

    def fingerprint(self, spec: str) -> dict:
        """The input's part of a job's identity: where it is and what it holds (row count and
        a hash of every id and text), so that a job never resumes over another input."""
        digest = hashlib.sha256()
        for row_id, text in zip(self.ids, self.texts):
            digest.update(repr(row_id).encode())
            if text is None:
                digest.update(b"\0")
            elif isinstance(text, bytes):  # not valid UTF-8: hashed as it is
                digest.update(b"\2" + text)
            else:
                digest.update(b"\1" + text.encode("utf-8", "replace"))
            digest.update(b"\n")
        fs, path = filesystem_and_path(spec)
        where = path if isinstance(fs, pafs.LocalFileSystem) else spec
        return {"input": where, "input_rows": len(self.ids),
                "input_sha256": digest.hexdigest()[:16]}


def filesystem_and_path(uri_or_path: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path on it; local paths are made absolute."""
    if "://" in uri_or_path:
        try:
            return pafs.FileSystem.from_uri(uri_or_path)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
            raise UserError(f"cannot open {uri_or_path!r}: {e}") from None
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri_or_path))


def _visible(path: str, base: str) -> bool:
    rel = posixpath.relpath(path, base) if base else path
    return not any(part.startswith((".", "_")) for part in rel.split("/") if part)


def glob_regex(pattern: str) -> re.Pattern:
    """Shell-style glob to regex: ``*``/``?`` stay within a segment, ``**`` crosses them."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def list_input_files(spec: str) -> tuple[pafs.FileSystem, list[str]]:
    """Expand ``--input`` into a sorted list of files."""
    fs, path = filesystem_and_path(spec)
    path = path.replace(os.sep, "/") if isinstance(fs, pafs.LocalFileSystem) else path
    if any(c in path for c in _GLOB_CHARS):
        parts = path.split("/")
        first = next(i for i, p in enumerate(parts) if any(c in p for c in _GLOB_CHARS))
        base = "/".join(parts[:first]) or "/"
        try:
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        except OSError as e:
            raise UserError(f"--input {spec!r}: cannot list {base!r}: {e}") from None
        pattern = glob_regex(path)
        files = sorted(i.path for i in infos if i.type == pafs.FileType.File
                       and pattern.match(i.path) and _visible(i.path, base))
        if not files:
            raise UserError(f"--input {spec!r}: no file matches the pattern")
        return fs, files
    try:
        info = fs.get_file_info(path)
    except OSError as e:
        raise UserError(f"--input {spec!r}: {e}") from None
    if info.type == pafs.FileType.NotFound:
        raise UserError(f"--input {spec!r}: no such file or directory")
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        files = sorted(i.path for i in infos
                       if i.type == pafs.FileType.File and _visible(i.path, path))
        if not files:
            raise UserError(f"--input {spec!r}: the directory holds no files")
        return fs, files
    return fs, [path]


def read_input(spec: str, id_column: str, text_column: str) -> InputRows:
    """Read and check the id and text columns of every input file (file-level checks)."""
    fs, files = list_input_files(spec)
    tables = []
    for path in files:
        try:
            with fs.open_input_file(path) as f:
                pf = pq.ParquetFile(f)
                schema = pf.schema_arrow
                missing = [c for c in (id_column, text_column) if c not in schema.names]
                if missing:
                    raise UserError(
                        f"{path}: missing column{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(repr, missing))}; it has {', '.join(schema.names)} "
                        f"(choose columns with --id-column / --text-column / --prompt-column)")
                table = pf.read(columns=[id_column, text_column])
        except UserError:
            raise
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
            raise UserError(f"{path} is not a readable Parquet file: {e}") from None
        tables.append(_check_types(table, path, id_column, text_column))
    try:
        table = pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise UserError(f"--input {spec!r}: the files' schemas disagree: {e}") from None
    if table.num_rows == 0:
        raise UserError(f"--input {spec!r}: no rows (read {len(files)} file(s))")
    ids = table.column(id_column)
    if ids.null_count:
        raise UserError(f"--input {spec!r}: {ids.null_count} row(s) have a null {id_column!r}")
    counts = pc.value_counts(ids)
    dup = pc.filter(counts, pc.greater(counts.field("counts"), 1))
    if len(dup):
        examples = ", ".join(repr(v) for v in dup.field("values").to_pylist()[:5])
        raise UserError(f"--input {spec!r}: {len(dup)} duplicate {id_column!r} value(s), e.g. "
                        f"{examples}: ids must be unique (they key checkpoints and resume)")
    log.info("input: %d rows from %d file(s)", table.num_rows, len(files))
    return InputRows(files=files, ids=ids.to_pylist(),
                     texts=_texts(table.column(text_column)), id_type=ids.type)


def _texts(column: pa.ChunkedArray) -> list:
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


def _as_binary(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A string / binary column (large or not) as binary, its bytes unchecked: pyarrow does
    not validate a string column's UTF-8 on read, and a cast or ``to_pylist`` would fail the
    whole file on its first bad value; ``_texts`` decodes row by row instead."""
    views = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}
    chunks = [c.view(views[c.type]) if c.type in views else c for c in column.chunks]
    return pa.chunked_array([c.cast(pa.binary()) for c in chunks], type=pa.binary())


def _check_types(table: pa.Table, path: str, id_column: str, text_column: str) -> pa.Table:
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
    text_type = table.schema.field(text_column).type
    if pa.types.is_dictionary(text_type):
        text_type = text_type.value_type
        table = table.set_column(table.schema.get_field_index(text_column), text_column,
                                 table.column(text_column).cast(text_type))
    if pa.types.is_null(text_type):  # every value null: row-level errors, not a file error
        column = table.column(text_column).cast(pa.binary())
    elif (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)
          or pa.types.is_binary(text_type) or pa.types.is_large_binary(text_type)):
        column = _as_binary(table.column(text_column))
    else:
        raise UserError(f"{path}: column {text_column!r} has type {text_type}; expected strings "
                        "(or binary UTF-8 text)")
    return table.set_column(table.schema.get_field_index(text_column), text_column, column)
