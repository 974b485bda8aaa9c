"""Ray Data: a job's input read and tokenized on the cluster's CPUs, streamed to the driver.

Why Ray Data here and not in dispatch: reading Parquet and tokenizing documents are
stateless CPU work that parallelizes over blocks, which Ray Data does with backpressure (a
bounded number of blocks in flight; the driver pulls batches as its replicas take rows).
The replicas stay the Engine's actors, fed by jobs/dispatch.py (see its docstring).

The driver holds one or two batches of token ids at a time, never a document's text.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Callable

import pyarrow as pa
import pyarrow.fs as pafs
import ray

log = logging.getLogger(__name__)


def stream_batches(files: list[str], filesystem: pafs.FileSystem, columns: list[str],
                   stage: Callable, stage_args: tuple, *, batch_rows: int, workers: int,
                   cpus: float, map_rows: int = 16,
                   block_bytes: int = 1 << 20) -> Iterator[pa.Table]:
    """``stage(*stage_args)`` (a callable class: a table in, a table out) over the Parquet
    ``files`` on a pool of ``workers`` Ray Data actors of ``cpus`` CPUs each; the results in
    tables of at most ``batch_rows`` rows, in no fixed order, as they are ready.

    ``cpus`` may be 0 (the reads always reserve none): a stage that waits for CPUs the
    replicas reserved would never start, and a CPU engine may reserve every CPU of a machine
    (its ranks then share cores with the tokenizers).
    ``map_rows``: rows per call of the stage (small: the first rows arrive early)."""
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the job's own progress lines say how far it is
    # Small blocks: a stage's output leaves its worker once a block is full, so with Ray's
    # default (128 MiB) the first rows of a file would wait for the whole file.
    ctx.target_max_block_size = block_bytes
    ds = ray.data.read_parquet(files, filesystem=filesystem, columns=columns,
                               file_extensions=None, num_cpus=0)
    # A pool that grows from one actor as the backlog asks: a fixed pool larger than the
    # input's blocks has actors still starting when the input is done, and Ray Data fails
    # the whole Dataset when such an actor is cancelled (seen on a busy machine).
    pool = ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, min(workers, len(files))))
    ds = ds.map_batches(stage, fn_constructor_args=stage_args, batch_format="pyarrow",
                        batch_size=map_rows, compute=pool, num_cpus=cpus)
    for batch in ds.iter_batches(batch_size=batch_rows, batch_format="pyarrow",
                                 prefetch_batches=2):
        if batch.num_rows:
            yield batch
