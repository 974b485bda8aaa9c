"""Ray Data: a job's input read and tokenized on the cluster's CPUs, streamed to the driver.

Why Ray Data here: reading Parquet and tokenizing documents are stateless CPU work that
parallelizes over blocks, which Ray Data does with backpressure (a bounded number of blocks
in flight; the driver pulls blocks as its replicas take rows). The stage is the processor's
own tokenize stage (runtime/stages.py); the rows then go to the job's replicas through the
Dispatcher (runtime/dispatch.py), not to a Ray Data engine stage (see runtime/stages.py why).

The driver holds one or two batches of token ids at a time, never a document's text.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import ray

from knapspec_dist.runtime.stages import Stage

log = logging.getLogger(__name__)


def stream_batches(files: list[str], filesystem: pafs.FileSystem, columns: list[str],
                   stage: Stage, *, batch_rows: int,
                   block_bytes: int = 1 << 20) -> Iterator[pa.Table]:
    """``stage`` over the Parquet ``files``' ``columns``; the results in tables of at most
    ``batch_rows`` rows, in no fixed order, as they are ready.

    The stage's ``cpus`` may be 0 (the reads always reserve none): a stage that waits for
    CPUs the replicas reserved would never start, and a CPU engine may reserve every CPU of
    a machine (its ranks then share cores with the tokenizers). Its ``rows`` per call are
    few, so that the first rows arrive early."""
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the job's own progress lines say how far it is
    # Small blocks: a stage's output leaves its worker once a block is full, so with Ray's
    # default (128 MiB) the first rows of a file would wait for the whole file.
    ctx.target_max_block_size = block_bytes
    # At most one read task per tokenizer actor: reads cost less than tokenizing, and reads
    # beyond that only take CPUs the tokenizer actor needs to start (on 2 busy cores, 12
    # files: 105 s to the first row against 116 s uncapped; noisy, the gain is small).
    hi = stage.actors[1] if isinstance(stage.actors, tuple) else stage.actors
    # Ray warns when the files come as fewer inputs than that limit: nothing to act on.
    warnings.filterwarnings("ignore", message="The maximum number of concurrent tasks for "
                            "'ReadFiles")
    ds = ray.data.read_parquet(files, filesystem=filesystem, columns=columns,
                               file_extensions=None, num_cpus=0, concurrency=max(1, hi))
    # The blocks are fetched here, in the calling thread, not by ``iter_batches``: its
    # consumer threads outlive an early stop (``--stop-after``) while one waits on a block,
    # and a thread that touches Ray after ``ray.shutdown`` ends the whole process with exit
    # status 1 (Ray's "core worker has already been shutdown"), every row written or not.
    # Dropping this iterator shuts the executor down (it joins its own thread).
    bundles = stage.on(ds).iter_internal_ref_bundles()
    try:
        for bundle in bundles:
            for table in ray.get(bundle.block_refs):
                for start in range(0, table.num_rows, batch_rows):
                    yield table.slice(start, batch_rows)
    finally:
        del bundles
