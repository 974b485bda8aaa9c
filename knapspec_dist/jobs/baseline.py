"""Which rows the baseline passes run again (with the job's strategy, then ``ar``).

Chosen after the main pass from the output's id and length columns (Arrow arrays, no row
object: the prompts are not held for this), deterministically, so a resumed job picks the
same rows.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc

from knapspec_dist.jobs.output import ROWS, OutputDir


def _steps(n: int, fraction: float) -> list[int]:
    """Positions, in length order, of the ``ceil(fraction * n)`` rows picked (at least one
    when ``fraction > 0``): even steps, so the shortest and longest are in when two or more
    are picked, and the median length when one is."""
    if fraction <= 0 or not n:
        return []
    k = min(n, max(1, math.ceil(fraction * n - 1e-9)))
    if k == 1:
        return [(n - 1) // 2]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def choose_baseline(rows, fraction: float) -> set:
    """Ids of the rows also run with ``ar``, from ``(id, num_input_tokens)`` of the rows that
    have a prompt: sorted by length (ties by id as text), picked at :func:`_steps`."""
    valid = sorted(rows, key=lambda r: (r[1], str(r[0])))
    return {valid[i][0] for i in _steps(len(valid), fraction)}


def baseline_ids(out: OutputDir, schema: pa.Schema, fraction: float) -> pa.Array:
    """Ids of the baseline rows that are ok in the output: :func:`choose_baseline` over the
    written rows that have a prompt, computed on their id and length columns with Arrow."""
    id_column = schema.names[0]
    table = out.read_rows(ROWS, schema, [id_column, "num_input_tokens", "error", "error_kind"])
    has_prompt = pc.fill_null(pc.or_kleene(pc.not_equal(table.column("error_kind"), "input"),
                                           pc.is_null(table.column("error"))), True)
    table = table.filter(has_prompt)
    order = pc.sort_indices(pa.table({"n": table.column("num_input_tokens"),
                                      "id": pc.cast(table.column(id_column), pa.string())}),
                            sort_keys=[("n", "ascending"), ("id", "ascending")])
    picked = pc.take(order, pa.array(_steps(len(order), fraction), pa.int64()))
    chosen = table.take(picked)
    ok = chosen.filter(pc.is_null(chosen.column("error"))).column(id_column)
    return ok.combine_chunks() if len(ok.chunks) != 1 else ok.chunk(0)
