"""What an earlier run of a job wrote already: the ids to skip and the failed rows to retry.

Computed column by column with Arrow (pyarrow.compute) over the status columns of the
output parts (id, error, error_kind: never a generated text), so that neither the output's
ids nor the input's become Python objects: the rows left are an anti-join of the input's
id array with the done ids (jobs/inputs.py keeps the input's ids as one Arrow array).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from knapspec_dist.jobs.output import (
    BASELINE,
    BASELINE_STRATEGY,
    RETRYABLE,
    ROWS,
    OutputDir,
)

STATUS = ["error", "error_kind"]


@dataclass
class Done:
    """The output's ids by pass, less the rows to retry; ``pending``: input rows left."""

    rows: pa.Array  # ids of the main pass's rows that stay written
    retry: int  # failed rows of the input a rerun generates again
    baseline: pa.Array  # ids done by the ar baseline pass
    again: pa.Array  # ids done by the strategy's baseline pass
    in_input: int  # input rows written already
    pending: int  # input rows left to generate

    @property
    def not_in_input(self) -> int:
        return len(self.rows) - self.in_input


def retryable(table: pa.Table) -> pa.Array:
    """Per row: whether it failed for a reason a rerun may not meet again (out of memory, a
    lost or hung replica; output.is_retryable, as an Arrow mask). Rows written before
    ``error_kind`` existed: by their message."""
    error, kind = table.column("error"), table.column("error_kind")
    by_kind = pc.is_in(kind, value_set=pa.array(RETRYABLE, pa.string()))
    by_message = pc.or_(pc.or_(pc.starts_with(error, "replica failed "),
                               pc.match_substring(error, "OutOfMemoryError")),
                        pc.starts_with(error, "MemoryError"))
    mask = pc.if_else(pc.is_null(kind), by_message, by_kind)
    return pc.fill_null(pc.and_(pc.is_valid(error), mask), False)


def _done(table: pa.Table, retry_failed: bool, inputs: pa.ChunkedArray | None) -> tuple:
    """(ids that stay written, how many rows to retry) of one subdirectory."""
    ids = table.column(0)
    failed = pc.is_valid(table.column("error"))
    retry = failed if retry_failed else retryable(table)
    if inputs is not None:  # a row whose id is no longer in the input is left as it is
        retry = pc.and_(retry, pc.is_in(ids, value_set=inputs))
    retry = pc.fill_null(retry, False)
    kept = pc.filter(ids, pc.invert(retry))
    return (kept.combine_chunks() if isinstance(kept, pa.ChunkedArray) else kept,
            pc.sum(retry).as_py() or 0)


def read_done(out: OutputDir, schema: pa.Schema, inputs: pa.ChunkedArray,
              retry_failed: bool) -> Done:
    """The :class:`Done` of the output directory ``out`` for the input ids ``inputs``."""
    id_column = schema.names[0]
    rows, retry = _done(out.read_rows(ROWS, schema, [id_column, *STATUS]), retry_failed,
                        inputs)
    baseline, _ = _done(out.read_rows(BASELINE, schema, [id_column, *STATUS]), retry_failed,
                        None)
    again, _ = _done(out.read_rows(BASELINE_STRATEGY, schema, [id_column, *STATUS]),
                     retry_failed, None)
    in_input = pc.sum(pc.is_in(inputs, value_set=rows)).as_py() or 0 if len(rows) else 0
    return Done(rows=rows, retry=retry, baseline=baseline, again=again, in_input=in_input,
                pending=len(inputs) - in_input)
