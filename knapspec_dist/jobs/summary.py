"""``summary.json`` from the rows a job wrote (``speedup.png``: jobs/plot.py).

Every figure comes from the output rows themselves, so the summary of a resumed job covers
all its runs.  Definitions (all over rows without an error):

* ``throughput``: what the job's replicas sustained together. ``tokens_per_s`` is generated
  tokens over the time some row was being generated (the union of the rows' admission-to-
  finish intervals: from the first admission to the last finish of a run, startup and the
  gaps between resumed runs excluded); ``decode_tokens_per_s`` the same with the prefill time
  taken out (the rows' prefill seconds over the replicas that served them: a replica prefills
  one row at a time); ``max_num_seqs`` the rows a replica decodes at once; ``mean_batch`` the
  rows decoding together per round, weighted by tokens.
* ``kv_cache``: the main pass's KV cache per rank (runtime/messages.py's ``KVReport``):
  ``paged``, ``page_size``, ``pages``, ``tokens``, ``bytes`` (the smallest replica's pool),
  ``max_num_seqs``; its use: ``peak_tokens`` and ``peak_use`` (the most reserved at once, and
  that as a share of the pool), ``peak_rows`` and ``mean_rows`` (rows in flight at most, and
  decoding per round on average), ``memory_wait_s`` (seconds the head of a replica's queue
  waited for pages with a slot free, summed over replicas) and ``rows_waited``.
* ``row_tokens_per_s``: generated tokens / the sum of the rows' own wall seconds. Rows that
  decode together share their wall time, so this is a per-row rate, not throughput.
* ``speedup``: on the baseline rows, run again after the main pass in two passes batched
  alike (same rows, replicas and ``max_num_seqs``), first with the job's strategy, then with
  ``ar``: the first pass's throughput (as above) over the second's. The main pass decoded
  those rows among all the others, at another batch, so its timings are not compared with
  ``ar``'s. ``decode_speedup`` leaves out the prefill time, which speculation does not
  change; ``strategy_mean_batch`` / ``ar_mean_batch`` say at which batch the two passes ran;
  ``row_speedup_*`` are per-row ratios between the passes; ``identical_tokens`` counts the
  baseline rows whose tokens *in the job's output* equal ``ar``'s (with greedy decoding or
  coupled sampling every one must: the method is lossless; ``job.sampling`` ``rejection``
  keeps plain sampling's distribution, not its tokens).
* buckets: rows grouped by prompt length (``num_input_tokens``) at powers of two.
* ``plans``: per plan the rows decoded with (``a3,m5@4``: skipped sublayers at draft length 4;
  ``ar``: plain decoding), summed over the ok rows: rounds, tokens, and the realized tokens
  per second per row (tokens over the rounds' draft and verify seconds) next to the predicted
  one (what the selection priced it at, over the seconds it priced), the ``PLANS_SHOWN``
  plans with the most seconds, the rest summed as ``other``.
* notes, present only when they apply: ``acceptance.note`` when a drafting strategy drafted
  no token in any ok row (it chose plain decoding throughout: no draft, copied or from a
  subnet, paid on this hardware); ``baseline.note`` when the strategy's baseline pass
  drafted nothing either, so ``speedup`` compares two plain-decoding passes: run-to-run
  noise, not a speedup.
* ``acceptance.by_source``: the drafted and accepted tokens of drafts copied from the rows'
  own tokens (``copied``) and of subnets (``subnet``).
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from knapspec_dist.engine.generation import add_plans, ranked_plans
from knapspec_dist.ratio import ratio

log = logging.getLogger(__name__)

BUCKET_EDGES = [0, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, math.inf]


def _label(lo: float, hi: float) -> str:
    def k(n):
        return "inf" if n == math.inf else (f"{n // 1024}k" if n >= 1024 else str(int(n)))
    return f"{k(lo)}-{k(hi)}"


def bucket_of(n: int) -> tuple[float, float]:
    for lo, hi in zip(BUCKET_EDGES, BUCKET_EDGES[1:]):
        if lo <= n < hi:
            return lo, hi
    raise ValueError(n)


#: Row errors by kind: the messages carry numbers (token counts, attempts), the kinds do not.
_KINDS = [
    (re.compile(r"prompt has \d+ tokens; with --max-new-tokens"),
     "prompt too long for the context window"),
    (re.compile(r"prompt has \d+ tokens and cannot be cut"), "prompt too long to truncate"),
    (re.compile(r"replica failed \d+ time"), "replica failed while generating"),
    (re.compile(r"('[^']*') is (null|empty)$"), None),  # the message is its kind
    (re.compile(r"('[^']*' is not valid UTF-8)"), "group"),
    (re.compile(r"([A-Za-z_][A-Za-z0-9_.]*(Error|Exception|Exit|Interrupt)):"), "group"),
]


def error_kind(message: str) -> str:
    """The kind of a row's error, for ``summary.json``'s ``errors`` counts: a fixed label for
    the errors the job itself writes, the exception class for a failed generation, else the
    first clause with its numbers replaced by N."""
    for pattern, kind in _KINDS:
        m = pattern.match(message)
        if m:
            return m.group(1) if kind == "group" else (kind or message)
    return re.sub(r"\d+", "N", message.split(";")[0].split(":")[0])[:120]


#: The columns of an output part the summary reads.
COLUMNS = ["num_input_tokens", "num_generated_tokens", "time_taken_llm", "prefill_s",
           "tokens_per_s", "drafted", "accepted", "copied_drafted", "copied_accepted",
           "attention_skipped", "mlp_skipped",
           "selections", "mean_batch", "replica", "generation_start", "generation_end",
           "generated_tokens", "error",  # the tokens: for the baseline rows (lossless)
           "document_path", "tree_generations"]


def column_or_nulls(table: pa.Table, name: str) -> pa.ChunkedArray:
    """A column, or nulls where the table lacks it (a part of an older version, a test's
    partial rows)."""
    if name in table.column_names and not pa.types.is_null(table.column(name).type):
        return table.column(name)
    # Absent, or all null in rows given as dicts (their type inferred as null): float nulls.
    return pa.chunked_array([pa.nulls(len(table), pa.float64())])


def _sum(values, zero=0):
    total = pc.sum(values).as_py()
    return zero if total is None else total


def _seconds(column: pa.ChunkedArray) -> np.ndarray:
    if pa.types.is_timestamp(column.type):
        column = pc.cast(pc.cast(column, pa.timestamp("us")), pa.int64())
        return column.to_numpy(zero_copy_only=False).astype(np.float64) / 1e6
    return column.to_numpy(zero_copy_only=False).astype(np.float64)


@dataclass
class Totals:
    """Running sums over ok rows (one table at a time: :meth:`add`), and the figures of
    the module docstring from them."""

    rows: int = 0
    generations: int = 0  # a tree row's nodes, one for any other row
    tokens: int = 0
    input_tokens: int = 0
    input_rows: int = 0  # rows with a prompt length (for the mean)
    wall: float = 0.0
    prefill: float = 0.0
    batch_weight: int = 0
    batch_sum: float = 0.0
    drafted: int = 0
    accepted: int = 0
    copied_drafted: int = 0
    copied_accepted: int = 0
    attention: float = 0.0  # attention_skipped x drafted
    mlp: float = 0.0
    selections: int = 0
    replicas: set = field(default_factory=set)
    spans: list = field(default_factory=list)  # (starts, ends) arrays in seconds

    def add(self, ok: pa.Table) -> Totals:
        """Add the rows of ``ok`` (rows without an error)."""
        if not len(ok):
            return self
        gen = pc.fill_null(column_or_nulls(ok, "num_generated_tokens"), 0)
        drafted = pc.fill_null(column_or_nulls(ok, "drafted"), 0)
        mean_batch = column_or_nulls(ok, "mean_batch")
        n_in = column_or_nulls(ok, "num_input_tokens")
        self.rows += len(ok)
        self.generations += int(_sum(pc.fill_null(column_or_nulls(ok, "tree_generations"), 1)))
        self.tokens += _sum(gen)
        self.input_tokens += _sum(n_in)
        self.input_rows += len(n_in) - n_in.null_count
        self.wall += _sum(column_or_nulls(ok, "time_taken_llm"), 0.0)
        self.prefill += _sum(column_or_nulls(ok, "prefill_s"), 0.0)
        self.batch_weight += _sum(pc.if_else(pc.is_valid(mean_batch), gen, 0))
        self.batch_sum += _sum(pc.multiply(mean_batch, gen), 0.0)
        self.drafted += _sum(drafted)
        self.accepted += _sum(column_or_nulls(ok, "accepted"))
        self.copied_drafted += _sum(pc.fill_null(column_or_nulls(ok, "copied_drafted"), 0))
        self.copied_accepted += _sum(pc.fill_null(column_or_nulls(ok, "copied_accepted"), 0))
        attention = pc.fill_null(column_or_nulls(ok, "attention_skipped"), 0)
        self.attention += _sum(pc.multiply(attention, drafted), 0.0)
        mlp = pc.fill_null(column_or_nulls(ok, "mlp_skipped"), 0)
        self.mlp += _sum(pc.multiply(mlp, drafted), 0.0)
        self.selections += _sum(column_or_nulls(ok, "selections"))
        self.replicas.update(pc.unique(column_or_nulls(ok, "replica")).to_pylist())
        start, end = column_or_nulls(ok, "generation_start"), column_or_nulls(ok, "generation_end")
        both = pc.and_(pc.is_valid(start), pc.is_valid(end))
        if pc.any(both).as_py():
            self.spans.append((_seconds(start.filter(both)), _seconds(end.filter(both))))
        return self

    def busy_seconds(self) -> float:
        """Length of the union of the rows' [generation_start, generation_end] intervals."""
        if not self.spans:
            return 0.0
        starts = np.concatenate([a for a, _ in self.spans])
        ends = np.concatenate([b for _, b in self.spans])
        order = np.lexsort((ends, starts))
        starts, ends = starts[order], ends[order]
        before = np.concatenate([[-np.inf], np.maximum.accumulate(ends)[:-1]])
        return float(np.sum(np.where(ends > before, ends - np.maximum(starts, before), 0.0)))

    def row_tokens_per_s(self) -> float | None:
        return ratio(self.tokens, self.wall)

    def throughput(self, max_num_seqs=None) -> dict:
        """Job-level throughput of the ok rows (see the module docstring)."""
        busy = self.busy_seconds()
        prefill = self.prefill / (len(self.replicas) or 1)
        return {"tokens_per_s": ratio(self.tokens, busy),
                "decode_tokens_per_s": ratio(self.tokens, busy - prefill),
                "max_num_seqs": max_num_seqs,
                "mean_batch": ratio(self.batch_sum, self.batch_weight)}

    def acceptance(self) -> dict:
        d = self.drafted
        copied, kept = self.copied_drafted, self.copied_accepted
        return {"drafted": d, "accepted": self.accepted,
                "acceptance_rate": ratio(self.accepted, d),
                "attention_skipped": ratio(self.attention, d),
                "mlp_skipped": ratio(self.mlp, d), "selections": self.selections,
                "by_source": {  # drafts copied from the rows' own tokens, and subnets'
                    "copied": {"drafted": copied, "accepted": kept,
                               "acceptance_rate": ratio(kept, copied)},
                    "subnet": {"drafted": d - copied, "accepted": self.accepted - kept,
                               "acceptance_rate": ratio(self.accepted - kept, d - copied)}}}


def _table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows) if rows else pa.table({})


def throughput(rows: list[dict], max_num_seqs=None) -> dict:
    """:meth:`Totals.throughput` of ok rows given as dicts."""
    return Totals().add(_table(rows)).throughput(max_num_seqs)


PLANS_SHOWN = 12
#: ``baseline.note`` when both baseline passes decoded plainly.
NOISE_NOTE = "both passes decoded plainly: this is run-to-run noise, not a speedup"


def plain_note(strategy: str) -> str:
    """``acceptance.note`` when a drafting strategy drafted nothing."""
    return (f"{strategy} chose plain decoding for every row: no draft, copied or from a "
            "subnet, paid on this hardware")


def _acceptance_of_job(ok: Totals, strategy: str | None) -> dict:
    """The job's acceptance, with ``note`` when a drafting strategy drafted nothing at all."""
    acc = ok.acceptance()
    if ok.rows and strategy not in (None, "ar") and not acc["drafted"]:
        acc["note"] = plain_note(strategy)
    return acc


def _speedup(pairs: list[tuple[dict, dict]], lossless: list[tuple[dict, dict]]) -> dict:
    """pairs: (the job's strategy row from the baseline pass, ar row) of the same id, both
    ok; lossless: (the job's own row, ar row)."""
    identical = sum(list(s["generated_tokens"]) == list(a["generated_tokens"])
                    for s, a in lossless)
    if not pairs:
        return {"rows": 0, "speedup": None, "decode_speedup": None,
                "identical_tokens": identical}
    spec = Totals().add(_table([p[0] for p in pairs])).throughput()
    ar = Totals().add(_table([p[1] for p in pairs])).throughput()
    per_row = [r for s, a in pairs if (r := ratio(s["tokens_per_s"], a["tokens_per_s"]))]
    speedup = ratio(spec["tokens_per_s"], ar["tokens_per_s"])
    noise = {"note": NOISE_NOTE} if speedup is not None and not any(
        p[0]["drafted"] for p in pairs) else {}
    return {
        "rows": len(pairs),
        "speedup": speedup,
        **noise,
        "decode_speedup": ratio(spec["decode_tokens_per_s"], ar["decode_tokens_per_s"]),
        "strategy_tokens_per_s": spec["tokens_per_s"],
        "ar_tokens_per_s": ar["tokens_per_s"],
        "strategy_mean_batch": spec["mean_batch"],
        "ar_mean_batch": ar["mean_batch"],
        "row_speedup_median": statistics.median(per_row) if per_row else None,
        "row_speedup_min": min(per_row) if per_row else None,
        "row_speedup_max": max(per_row) if per_row else None,
        "identical_tokens": identical,
    }


@dataclass
class _Bucket:
    members: int = 0  # rows with a prompt length in the bucket, failed ones too
    input_tokens: int = 0
    ok: Totals = field(default_factory=Totals)


def _ok_rows(table: pa.Table | None, id_column: str) -> dict:
    if table is None:
        return {}
    return {r[id_column]: r for r in table.to_pylist() if r["error"] is None}


def summarize(rows: pa.Table | Iterable[pa.Table], baseline: pa.Table, id_column: str,
              input_ids, job: dict, run: dict, again: pa.Table | None = None,
              kv_cache: dict | None = None) -> dict:
    """The content of ``summary.json``: ``rows`` the main pass's rows (a table, or its parts
    one at a time: each read once, one row per id across them); ``baseline`` and ``again``
    the ar and strategy baseline passes' rows (small); ``input_ids`` the input's ids (an
    Arrow array or a list); ``kv_cache`` the main pass's KV cache and its use (a
    ``KVReport`` as a dict; None: no engine reported one)."""
    parts = [rows] if isinstance(rows, pa.Table) else rows
    inputs = input_ids if isinstance(input_ids, (pa.Array, pa.ChunkedArray)) else pa.array(
        list(input_ids))
    base = _ok_rows(baseline, id_column)
    again_ok = _ok_rows(again, id_column)
    base_ids = pa.array(list(base), inputs.type if len(inputs) else None)
    ok, written, in_input, failed = Totals(), 0, 0, 0
    plans: dict[str, dict] = {}
    errors: dict[str, int] = {}
    paths: dict[str, int] = {}  # how the rows' documents were summarized
    lossless: list[tuple[dict, dict]] = []
    buckets = [_Bucket() for _ in BUCKET_EDGES[1:]]
    edges = np.array(BUCKET_EDGES[1:-1], dtype=np.float64)
    for part in parts:
        if not len(part):
            continue
        written += len(part)
        ids = part.column(id_column)
        in_input += _sum(pc.is_in(ids, value_set=inputs)) if len(inputs) else 0
        is_ok = pc.is_null(part.column("error"))
        failed_part = part.filter(pc.invert(is_ok))
        failed += len(failed_part)
        for entry in pc.value_counts(failed_part.column("error")).to_pylist():
            kind = error_kind(entry["values"])
            errors[kind] = errors.get(kind, 0) + entry["counts"]
        for entry in pc.value_counts(column_or_nulls(part, "document_path")).to_pylist():
            if entry["values"] is not None:
                paths[entry["values"]] = paths.get(entry["values"], 0) + entry["counts"]
        ok_part = part.filter(is_ok)
        ok.add(ok_part)
        if "plans" in ok_part.column_names:
            add_plans(plans, ok_part.column("plans").to_pylist())
        if len(base):
            mine = ok_part.filter(pc.is_in(ok_part.column(id_column), value_set=base_ids))
            lossless += [(r, base[r[id_column]]) for r in mine.select(
                [id_column, "num_input_tokens", "generated_tokens"]).to_pylist()]
        n_in = part.column("num_input_tokens")
        where = np.searchsorted(edges, _seconds(n_in), side="right")
        for b in np.unique(where[~np.isnan(_seconds(n_in))]):
            mask = pa.array(where == b) if n_in.null_count == 0 else pc.and_(
                pa.array(where == b), pc.is_valid(n_in))
            members = part.filter(mask)
            buckets[b].members += len(members)
            buckets[b].input_tokens += _sum(members.column("num_input_tokens"))
            buckets[b].ok.add(members.filter(pc.is_null(members.column("error"))))
    pairs = [(again_ok[i], b) for i, b in base.items() if i in again_ok]
    out_buckets = []
    for (lo, hi), bucket in zip(zip(BUCKET_EDGES, BUCKET_EDGES[1:]), buckets):
        if not bucket.members:
            continue
        acc = bucket.ok.acceptance()
        out_buckets.append({
            "bucket": _label(lo, hi), "min_tokens": lo, "max_tokens": None if hi == math.inf
            else hi, "rows": bucket.members, "ok": bucket.ok.rows,
            "failed": bucket.members - bucket.ok.rows,
            "mean_input_tokens": bucket.input_tokens / bucket.members,
            "generated_tokens": bucket.ok.tokens,
            "row_tokens_per_s": bucket.ok.row_tokens_per_s(),
            **{k: acc[k] for k in ("acceptance_rate", "attention_skipped", "mlp_skipped")},
            "baseline": _speedup([p for p in pairs if lo <= p[0]["num_input_tokens"] < hi],
                                 [p for p in lossless
                                  if lo <= p[0]["num_input_tokens"] < hi])})
    return {
        "job": job,
        "complete": in_input == len(inputs),
        "rows": {"input": len(inputs), "written": written, "ok": ok.rows, "failed": failed,
                 "pending": len(inputs) - in_input, "not_in_input": written - in_input,
                 "generations": ok.generations, "document_paths": paths},
        "errors": errors,
        "tokens": {"input": ok.input_tokens, "generated": ok.tokens},
        "row_tokens_per_s": ok.row_tokens_per_s(),
        "throughput": ok.throughput(run.get("max_num_seqs")),
        "kv_cache": kv_cache,
        "generation_seconds": ok.wall,
        "acceptance": _acceptance_of_job(ok, job.get("strategy")),
        "plans": ranked_plans(plans, PLANS_SHOWN),
        "baseline": {"strategy": "ar", **_speedup(pairs, lossless)},
        "buckets": out_buckets,
        "run": run,
    }


def finite(value):
    """``value`` with every float that is not finite (nan, inf: a rate of no data, a bad
    timing) as None, in nested dicts, lists and tuples: what JSON can hold and a reader
    takes for "no figure"."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(summary: dict) -> bytes:
    """summary.json's bytes: strict JSON, never a nan or inf (:func:`finite`)."""
    return json.dumps(finite(summary), indent=2, default=str, allow_nan=False).encode() + b"\n"
