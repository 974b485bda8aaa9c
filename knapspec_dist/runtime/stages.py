"""The one description of the pipeline, shared by the Ray Data processor and the batch job.

A pipeline is ``preprocess -> tokenize -> engine -> postprocess``, as in ``ray.data.llm``:

* tokenize: :class:`~knapspec_dist.runtime.prompts.TokenizeStage` (chat template and
  tokenizer, per-row input errors), a :class:`Stage` that runs on Ray Data actors
  (:meth:`Stage.on`) or, for a small job, in the driver (:meth:`Stage.here`);
* engine: rows to replicas through :class:`~knapspec_dist.runtime.dispatch.Dispatcher`
  (replica restarts, retries, blame), rows in by :func:`batch_tasks`, results out as
  :func:`outcome_columns`.

Why the job does not run the engine stage as a Ray Data actor: it adds what Ray Data LLM
lacks around the same stages -- exactly-once part files, resume by an anti-join, retries
across replicas, the baseline passes and the summary -- and those need one owner of every
row's fate across all replicas (the driver's Dispatcher over the job's RayEngine). The
processor's engine stage (runtime/processor.py) is one replica per Ray Data actor, driving
the same Dispatcher over it, so both paths restart a dead replica and retry its rows alike.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import ray

from knapspec_dist.engine.generation import plan_records
from knapspec_dist.runtime.dispatch import Outcome, Task

__all__ = ["FORMER_NAMES", "PLANS", "RESULT_FIELDS", "Stage", "batch_tasks", "outcome_columns",
           "result_columns"]


@dataclass(frozen=True)
class Stage:
    """One ``map_batches`` of the pipeline: a callable class (a table in, a table out), its
    constructor arguments, rows per call, its actor pool (a size or a ``(min, max)`` range)
    and the CPUs each actor reserves."""

    fn: type
    args: tuple
    rows: int = 16
    actors: int | tuple[int, int] = 1
    cpus: float = 0.0

    def on(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        """The stage on Ray Data actors."""
        lo, hi = self.actors if isinstance(self.actors, tuple) else (self.actors, self.actors)
        pool = (ray.data.ActorPoolStrategy(size=lo) if lo == hi
                else ray.data.ActorPoolStrategy(min_size=lo, max_size=hi))
        return ds.map_batches(self.fn, fn_constructor_args=self.args, batch_format="pyarrow",
                              batch_size=self.rows, compute=pool, num_cpus=self.cpus)

    def here(self):
        """The same stage in this process (a callable)."""
        return self.fn(*self.args)


def _utc(epoch: float) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc) if epoch else None


def result_columns(result) -> dict:
    """A GenerationResult as output columns (``ray.data.llm``'s names where they overlap):
    the one mapping of our per-row statistics, for the processor's rows and the job's."""
    s = result.stats
    return {"generated_text": result.text, "generated_tokens": list(result.token_ids),
            "num_input_tokens": s.prompt_tokens, "num_generated_tokens": s.new_tokens,
            "finish_reason": result.finish_reason, "time_taken_llm": s.wall_s,
            "prefill_s": s.prefill_s, "tokens_per_s": s.tokens_per_s, "rounds": s.rounds,
            "drafted": s.drafted, "accepted": s.accepted, "acceptance_rate": s.acceptance_rate,
            "copied_drafted": s.copied_drafted, "copied_accepted": s.copied_accepted,
            "attention_skipped": s.attention_skipped, "mlp_skipped": s.mlp_skipped,
            "selections": s.selections, "mean_batch": s.mean_batch,
            "plans": plan_records(s.plans),
            "generation_start": _utc(s.admitted_at), "generation_end": _utc(s.finished_at)}


#: Per plan a row decoded with: its rounds, tokens, seconds, and the predicted tokens over the
#: seconds priced (engine/generation.py ``PlanTally``); jobs/summary.py sums them per plan.
PLANS = pa.list_(pa.struct([("plan", pa.string()), ("rounds", pa.int64()),
                            ("tokens", pa.int64()), ("seconds", pa.float64()),
                            ("predicted_tokens", pa.float64()), ("priced_s", pa.float64())]))


#: Columns the engine stage gives every row (null where the row failed); the job's output adds
#: its own (jobs/output.py ``output_schema``).
RESULT_FIELDS = [
    ("generated_text", pa.string()), ("generated_tokens", pa.list_(pa.int32())),
    ("num_input_tokens", pa.int64()), ("num_generated_tokens", pa.int64()),
    ("finish_reason", pa.string()),  # "eos" | "length"
    ("time_taken_llm", pa.float64()),  # wall seconds of this row's generation
    ("prefill_s", pa.float64()), ("tokens_per_s", pa.float64()), ("rounds", pa.int64()),
    ("drafted", pa.int64()), ("accepted", pa.int64()), ("acceptance_rate", pa.float64()),
    # of them, drafts copied from the row's own tokens (the rest: a subnet's)
    ("copied_drafted", pa.int64()), ("copied_accepted", pa.int64()),
    # mean attention / MLP sublayers skipped per draft token
    ("attention_skipped", pa.float64()), ("mlp_skipped", pa.float64()),
    ("selections", pa.int64()),
    ("mean_batch", pa.float64()),  # rows that decoded beside it, on average
    ("plans", PLANS),
    # when the replica admitted the row and finished it
    ("generation_start", pa.timestamp("us", tz="UTC")),
    ("generation_end", pa.timestamp("us", tz="UTC")),
    ("replica", pa.int32()),
    ("attempts", pa.int32()),  # submissions of this row (more than 1 after replica failures)
    ("error", pa.string()),  # null when the row succeeded
    ("error_kind", pa.string()),  # input | row | oom | replica | timeout (null: ok)
]

#: How a text row's document was summarized: "whole" (one prompt), "truncated" or "tree" (past
#: the window: a tree of chunk summaries, runtime/tree.py; null: no prompt, an input error);
#: a tree's chunks, levels, generations and tokens over all of them.
TREE_FIELDS = [
    ("document_path", pa.string()),
    ("tree_chunks", pa.int32()), ("tree_depth", pa.int32()), ("tree_generations", pa.int32()),
    ("tree_prompt_tokens", pa.int64()), ("tree_generated_tokens", pa.int64()),
]

#: Result columns renamed since outputs were first written: the name now -> the name in older
#: parts, read in its place where a part has only the older (jobs/parts.py), so a job resumes
#: and summarizes over the rows of earlier versions.
FORMER_NAMES = {"rounds": "steps"}


def outcome_columns(outcome: Outcome) -> dict:
    """A dispatched row's result columns (:data:`RESULT_FIELDS`), or its error and kind."""
    row = {"replica": outcome.replica, "attempts": outcome.task.attempts,
           "error": outcome.error, "error_kind": None}
    if outcome.error is not None:
        row["error_kind"] = outcome.kind or "row"
    elif outcome.result is not None:
        row.update(result_columns(outcome.result))
    return row


def batch_tasks(batch: pa.Table, keys: list) -> Iterator[tuple[int, Task | None]]:
    """``(row, its Task keyed by keys[row])`` of a tokenized batch, longest prompt first (long
    rows started first finish before the tail); None for a row whose prompt failed (its
    ``error`` column says why). A Task's token ids are a NumPy view of the batch."""
    lengths = batch.column("num_input_tokens").to_pylist()
    problems = batch.column("error").to_pylist()
    prompts = batch.column("prompt_ids").combine_chunks()
    offsets = prompts.offsets.to_numpy()
    values = prompts.values.to_numpy(zero_copy_only=False)
    for i in sorted(range(len(keys)), key=lambda i: (-(lengths[i] or 0), i)):
        yield i, (None if problems[i] is not None
                  else Task(keys[i], values[offsets[i]:offsets[i + 1]]))
