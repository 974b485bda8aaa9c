"""Reading an output directory's parts: one table a part, one row per id across them.

Exactly once on read: should an id appear in more than one row (a part file copied by hand,
a rerun that retried a failed row), one row per id is kept (:func:`keep_one_per_id`, over
the parts' status columns read first, with Arrow: no Python object per row) and a warning
says how many were dropped. The parts are then read one at a time, only the columns asked
for, so a reader (resume, the baseline choice, the summary) streams the output.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from knapspec_dist.runtime.stages import FORMER_NAMES

log = logging.getLogger(__name__)


def keep_one_per_id(status: pa.Table) -> tuple[np.ndarray, int]:
    """Indices of the rows to keep (one per id, in the given order) and how many were dropped;
    ``status``: the id, ``error`` and ``finished_at`` columns (Arrow, no row object).

    Which row of an id: a success over an error; among successes the earliest commit (by
    ``finished_at``, then the order given: part file names); among errors only the latest
    (the last attempt's kind decides whether a rerun retries the row)."""
    n = len(status)
    if not n:
        return np.zeros(0, np.int64), 0
    ok = pc.is_null(status.column("error")).to_numpy(zero_copy_only=False)
    at = pc.cast(pc.cast(status.column("finished_at"), pa.timestamp("us")), pa.int64())
    at = at.to_numpy(zero_copy_only=False).astype(np.float64)
    at = np.where(np.isnan(at), np.inf, at)
    index = np.arange(n, dtype=np.float64)
    keys = pa.table({"id": status.column(0), "k1": np.where(ok, 0, 1),
                     "k2": np.where(ok, at, np.where(np.isinf(at), np.inf, -at)),
                     "k3": np.where(ok, index, -index)})
    order = pc.sort_indices(keys, sort_keys=[(k, "ascending") for k in keys.column_names])
    ids = pc.take(status.column(0), order)
    first = np.ones(n, bool)
    if n > 1:
        first[1:] = pc.not_equal(ids.slice(1), ids.slice(0, n - 1)).to_numpy(
            zero_copy_only=False)
    keep = np.sort(order.to_numpy()[first])
    return keep, n - len(keep)


def iter_parts(out, sub: str, schema: pa.Schema,
           columns: list[str] | None = None) -> Iterator[pa.Table]:
    """The readable parts of ``DIR/sub``, one table a part, one row per id across them
    (:func:`keep_one_per_id` over their status columns, read first; the duplicates
    dropped are counted in a warning, once per directory). Columns a part lacks (written
    by an older version) read as nulls.

    Temporary leftovers of a crashed writer are deleted; unreadable parts are moved aside.
    ``columns``: read only those (and what choosing one row per id needs), e.g. the ids
    and errors of a resume, not every generated text.
    """
    if columns is not None:
        wanted = set(columns) | {schema.names[0], "error", "finished_at"}
        schema = pa.schema([f for f in schema if f.name in wanted])
    status_schema = pa.schema([f for f in schema
                               if f.name in (schema.names[0], "error", "finished_at")])
    parts = [(path, table) for path in _part_paths(out, sub)
             if (table := _read_part(out, sub, path, status_schema)) is not None]
    if not parts:
        return
    keep, dropped = keep_one_per_id(pa.concat_tables([t for _, t in parts]))
    if dropped and sub not in out._warned:
        out._warned.add(sub)
        log.warning("%s: %d duplicate row(s) dropped on reading (an id in more than "
                    "one row: a copied part file?); kept one row per id, a success "
                    "over an error, then the earliest", out.display(sub), dropped)
    start = 0
    for path, status in parts:
        end = start + len(status)
        mine = keep[(keep >= start) & (keep < end)] - start
        start = end
        if not len(mine):
            continue
        table = (status if schema.names == status_schema.names
                 else _read_part(out, sub, path, schema))
        if table is None:
            continue
        yield table if len(mine) == len(table) else table.take(pa.array(mine, pa.int64()))

def last_record(out, sub: str, key: bytes) -> dict:
    """The JSON object the newest part of ``DIR/sub`` holding ``key`` in its schema metadata
    keeps there (empty when none does); only footers are read."""
    for path in reversed(_part_paths(out, sub)):
        try:
            with out.fs.open_input_file(path) as f:
                metadata = pq.ParquetFile(f).schema_arrow.metadata or {}
            if key in metadata:
                record = json.loads(metadata[key])
                return record if isinstance(record, dict) else {}
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError):
            continue  # an unreadable part: the rows' reader moves it aside
    return {}


def _part_paths(out, sub: str) -> list[str]:
    """The part files of ``DIR/sub`` by name; temporary leftovers deleted."""
    infos = out.fs.get_file_info(pafs.FileSelector(out.join(sub), allow_not_found=True))
    paths = []
    for info in sorted(infos, key=lambda i: i.path):
        name = os.path.basename(info.path)
        if info.type != pafs.FileType.File:
            continue
        if name.startswith(".") and name.endswith(".tmp"):
            log.info("removing %s (left by an interrupted write)", info.path)
            out.fs.delete_file(info.path)
            continue
        if name.startswith((".", "_")) or not name.endswith(".parquet"):
            continue
        paths.append(info.path)
    return paths

def _read_part(out, sub: str, path: str, schema: pa.Schema) -> pa.Table | None:
    """One part's ``schema`` columns (a renamed one from its former name, ``FORMER_NAMES``;
    nulls where it lacks one); None when it cannot be read (then it is moved aside and its
    rows computed again)."""
    try:
        with out.fs.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            have = pf.schema_arrow.names
            names = {n: n if n in have else FORMER_NAMES.get(n) for n in schema.names}
            names = {n: old for n, old in names.items() if old in have}
            table = pf.read(columns=list(names.values())).rename_columns(list(names))
        for field_ in schema:
            if field_.name not in table.column_names and field_.nullable:
                table = table.append_column(field_.name, pa.nulls(len(table), field_.type))
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, KeyError) as e:
        aside = f"{out.join(sub)}/.corrupt-{os.path.basename(path)}"
        log.warning("cannot read part %s (%s); moving it to %s, its rows will be "
                    "computed again", path, e, aside)
        out.fs.move(path, aside)
        return None
