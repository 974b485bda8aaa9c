"""Check the job's input Parquet as a whole before any model is loaded; stream its texts.

``--input`` is a Parquet file, a directory of them (searched recursively; names starting
with ``.`` or ``_`` are skipped, as pyarrow and Spark do) or a glob (``*`` and ``?`` within
one path segment, ``**`` across segments: ``/data/**/*.parquet``), given as a local path or
a URI any pyarrow filesystem reads (``s3://``, ``gs://``, ``hdfs://``, ``file://``).

File-level problems raise :class:`~knapspec_dist.errors.UserError` with a message that
names the file and the fix: nothing found, a file that is not Parquet, a missing column, a
column of the wrong type, a null id, duplicate ids, no rows.  Row-level problems (a null or
empty text, a text that is not valid UTF-8, a prompt too long for the context window) are
not checked here: they become that row's ``error`` (see runtime/prompts.py).

Text columns are strings, or binary columns holding UTF-8 text (decoded row by row).  A
value that is not valid UTF-8 (Parquet does not check the bytes of a string column, so such
files exist) is kept as its raw ``bytes``; runtime/prompts.py's PromptBuilder turns it into
that row's error and the other rows run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from knapspec_dist.errors import UserError
from knapspec_dist.runtime.prompts import check_id_type, normalize, text_value_type

log = logging.getLogger(__name__)

_GLOB_CHARS = set("*?[")


@dataclass
class InputScan:
    """The job's input as checked before any model loads: its files and their id column.

    Texts are not read here: they stream through the tokenize stage (:func:`iter_texts`,
    or Ray Data in runtime/stream.py) batch by batch.  The ids are kept as one Arrow array
    (a few bytes per row, no Python objects): the file-level checks (nulls, duplicates),
    the anti-join of resume and the row count need them."""

    files: list[str]
    fs: pafs.FileSystem
    ids: pa.ChunkedArray  # the id column, input order
    id_type: pa.DataType
    text_column: str
    id_column: str
    digest: str  # ids and the text column chunks' metadata (see ``fingerprint``)

    def __len__(self) -> int:
        return len(self.ids)

    def fingerprint(self, spec: str) -> dict:
        """The input's part of a job's identity: where it is and what it holds, so that a
        job never resumes over another input.  The hash covers every id and, per row group,
        the text column's sizes and statistics (any edit of a text changes its compressed
        size): computed from the Parquet footers, without reading the texts."""
        fs, path = filesystem_and_path(spec)
        where = path if isinstance(fs, pafs.LocalFileSystem) else spec
        return {"input": where, "input_rows": len(self.ids), "input_sha256": self.digest}


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


def read_input(spec: str, id_column: str, text_column: str) -> InputScan:
    """Check every input file (footer and id column only: file-level checks) and read its
    ids; the texts stay on disk for the tokenize stage."""
    fs, files = list_input_files(spec)
    id_chunks, digest = [], hashlib.sha256()
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
                _check_text_type(schema.field(text_column).type, path, text_column)
                table = pf.read(columns=[id_column])
                _digest_footer(digest, pf.metadata, schema.get_field_index(text_column))
        except UserError:
            raise
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
            raise UserError(f"{path} is not a readable Parquet file: {e}") from None
        id_chunks.append(check_id_type(table, path, id_column).column(id_column))
    types = sorted({str(c.type) for c in id_chunks})
    if len(types) > 1:
        raise UserError(f"--input {spec!r}: the files' schemas disagree: id columns of types "
                        f"{', '.join(types)}")
    ids = pa.chunked_array([c for chunk in id_chunks for c in chunk.chunks],
                           type=id_chunks[0].type)
    if len(ids) == 0:
        raise UserError(f"--input {spec!r}: no rows (read {len(files)} file(s))")
    if ids.null_count:
        raise UserError(f"--input {spec!r}: {ids.null_count} row(s) have a null {id_column!r}")
    counts = pc.value_counts(ids)
    dup = pc.filter(counts, pc.greater(counts.field("counts"), 1))
    if len(dup):
        examples = ", ".join(repr(v) for v in dup.field("values").to_pylist()[:5])
        raise UserError(f"--input {spec!r}: {len(dup)} duplicate {id_column!r} value(s), e.g. "
                        f"{examples}: ids must be unique (they key checkpoints and resume)")
    for chunk in ids.chunks:
        digest.update(_id_bytes(chunk))
    log.info("input: %d rows from %d file(s)", len(ids), len(files))
    return InputScan(files=files, fs=fs, ids=ids, id_type=ids.type, text_column=text_column,
                     id_column=id_column, digest=digest.hexdigest()[:16])


def _id_bytes(chunk: pa.Array) -> bytes:
    """The raw buffers of one id chunk (values and offsets): hashing them needs no Python
    object per id."""
    chunk = chunk if chunk.offset == 0 else pa.concat_arrays([chunk])
    return b"".join(bytes(b) for b in chunk.buffers()[1:] if b is not None)


def _digest_footer(digest, meta: pq.FileMetaData, text_index: int) -> None:
    """What a Parquet footer says of the text column, row group by row group."""
    digest.update(f"rows {meta.num_rows} groups {meta.num_row_groups}\n".encode())
    for g in range(meta.num_row_groups):
        col = meta.row_group(g).column(text_index)
        stats = col.statistics
        digest.update(repr((meta.row_group(g).num_rows, col.total_compressed_size,
                            col.total_uncompressed_size, col.compression,
                            stats.null_count if stats is not None and stats.has_null_count
                            else None)).encode())


def legacy_digest(scan: InputScan, batch_rows: int = 256) -> str:
    """``input_sha256`` in its first form (every id and text, in input order), which older
    outputs' job.json hold; streamed a batch at a time: a migration, computed only to resume
    such an output (see OutputDir.check)."""
    digest = hashlib.sha256()
    for table in iter_texts(scan, batch_rows):
        for row_id, raw in zip(table.column(0).to_pylist(), table.column(1).to_pylist()):
            digest.update(repr(row_id).encode())
            if raw is None:
                digest.update(b"\0")
            else:
                try:
                    raw.decode("utf-8")
                    digest.update(b"\1" + raw)
                except UnicodeDecodeError:  # not valid UTF-8: hashed as it is
                    digest.update(b"\2" + raw)
            digest.update(b"\n")
    return digest.hexdigest()[:16]


def iter_texts(scan: InputScan, batch_rows: int) -> Iterator[pa.Table]:
    """The input as tables of at most ``batch_rows`` rows (id, text as binary), file by
    file and row group by row group: this process holds one batch of texts at a time."""
    for path in scan.files:
        with scan.fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            for batch in pf.iter_batches(batch_size=batch_rows,
                                         columns=[scan.id_column, scan.text_column]):
                yield normalize(pa.Table.from_batches([batch]), scan.id_column,
                                scan.text_column)


def _check_text_type(text_type: pa.DataType, path: str, text_column: str) -> None:
    t = text_value_type(text_type)
    if not (pa.types.is_null(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        raise UserError(f"{path}: column {text_column!r} has type {t}; expected strings "
                        "(or binary UTF-8 text)")
