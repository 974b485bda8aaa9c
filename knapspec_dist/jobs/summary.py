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
* ``row_tokens_per_s``: generated tokens / the sum of the rows' own wall seconds. Rows that
  decode together share their wall time, so this is a per-row rate, not throughput.
* ``speedup``: on the baseline rows, run again after the main pass in two passes batched
  alike (same rows, replicas and ``max_num_seqs``), first with the job's strategy, then with
  ``ar``: the first pass's throughput (as above) over the second's. The main pass decoded
  those rows among all the others, at another batch, so its timings are not compared with
  ``ar``'s. ``decode_speedup`` leaves out the prefill time, which speculation does not
  change; ``strategy_mean_batch`` / ``ar_mean_batch`` say at which batch the two passes ran;
  ``row_speedup_*`` are per-row ratios between the passes; ``identical_tokens`` counts the
  baseline rows whose tokens *in the job's output* equal ``ar``'s (with greedy decoding every
  one must: the method is lossless).
* buckets: rows grouped by prompt length (``num_input_tokens``) at powers of two.
* ``plans``: per plan the rows decoded with (``a3,m5@4``: skipped sublayers at draft length 4;
  ``ar``: plain decoding), summed over the ok rows: rounds, tokens, and the realized tokens
  per second per row (tokens over the rounds' draft and verify seconds) next to the predicted
  one (what the selection priced it at, over the seconds it priced), the ``PLANS_SHOWN``
  plans with the most seconds, the rest summed as ``other``.
* notes, present only when they apply: ``acceptance.note`` when a drafting strategy drafted
  no token in any ok row (it chose plain decoding throughout: no subnet paid on this
  hardware); ``baseline.note`` when the strategy's baseline pass drafted nothing either, so
  ``speedup`` compares two plain-decoding passes: run-to-run noise, not a speedup.
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics

import pyarrow as pa

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
    (re.compile(r"prompt has \d+ tokens; with --max-new-tokens"), "prompt too long for the context window"),
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


def _throughput(rows: list[dict]) -> float | None:
    tokens = sum(r["num_generated_tokens"] for r in rows)
    wall = sum(r["time_taken_llm"] for r in rows)
    return tokens / wall if wall > 0 else None


def _busy_seconds(rows: list[dict]) -> float:
    """Length of the union of the rows' [generation_start, generation_end] intervals."""
    spans = sorted((r["generation_start"].timestamp(), r["generation_end"].timestamp())
                   for r in rows if r.get("generation_start") and r.get("generation_end"))
    total, end = 0.0, -math.inf
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def throughput(rows: list[dict], max_num_seqs=None) -> dict:
    """Job-level throughput of the ok rows (see the module docstring)."""
    tokens = sum(r["num_generated_tokens"] for r in rows)
    busy = _busy_seconds(rows)
    replicas = len({r["replica"] for r in rows}) or 1
    prefill = sum(r["prefill_s"] or 0 for r in rows) / replicas
    weight = sum(r["num_generated_tokens"] for r in rows if r.get("mean_batch") is not None)
    return {"tokens_per_s": tokens / busy if busy > 0 else None,
            "decode_tokens_per_s": tokens / (busy - prefill) if busy > prefill else None,
            "max_num_seqs": max_num_seqs,
            "mean_batch": (sum(r["mean_batch"] * r["num_generated_tokens"] for r in rows
                               if r.get("mean_batch") is not None) / weight) if weight else None}


def _ratio(a, b):
    return a / b if a is not None and b else None


def _acceptance(rows: list[dict]) -> dict:
    drafted = sum(r["drafted"] or 0 for r in rows)
    accepted = sum(r["accepted"] or 0 for r in rows)

    def weighted(col):
        return (sum((r[col] or 0) * (r["drafted"] or 0) for r in rows) / drafted
                if drafted else None)
    return {"drafted": drafted, "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "attention_skipped": weighted("attention_skipped"),
            "mlp_skipped": weighted("mlp_skipped"),
            "selections": sum(r["selections"] or 0 for r in rows)}


PLANS_SHOWN = 12


def _plans(rows: list[dict]) -> list[dict]:
    """``plans`` (see the module docstring) from the rows' per-plan tallies."""
    sums: dict[str, dict] = {}
    keys = ("rounds", "tokens", "seconds", "predicted_tokens", "priced_s")
    for r in rows:
        for t in r.get("plans") or ():
            acc = sums.setdefault(t["plan"], dict.fromkeys(keys, 0) | {"rows": 0})
            acc["rows"] += 1
            for k in keys:
                acc[k] += t[k] or 0
    ranked = sorted(sums.items(), key=lambda kv: -kv[1]["seconds"])
    if len(ranked) > PLANS_SHOWN:
        rest = dict.fromkeys(keys, 0) | {"rows": 0}
        for _, acc in ranked[PLANS_SHOWN:]:
            for k in rest:
                rest[k] += acc[k]
        ranked = ranked[:PLANS_SHOWN] + [("other", rest)]
    return [{"plan": label, "rows": acc["rows"], "rounds": acc["rounds"], "tokens": acc["tokens"],
             "tokens_per_s": _ratio(acc["tokens"], acc["seconds"]),
             "predicted_tokens_per_s": _ratio(acc["predicted_tokens"], acc["priced_s"])}
            for label, acc in ranked]


#: ``baseline.note`` when both baseline passes decoded plainly.
NOISE_NOTE = "both passes decoded plainly: this is run-to-run noise, not a speedup"


def plain_note(strategy: str) -> str:
    """``acceptance.note`` when a drafting strategy drafted nothing."""
    return f"{strategy} chose plain decoding for every row: no subnet paid on this hardware"


def _acceptance_of_job(ok: list[dict], strategy: str | None) -> dict:
    """``_acceptance`` of the job's ok rows, with ``note`` when a drafting strategy drafted
    nothing at all."""
    acc = _acceptance(ok)
    if ok and strategy not in (None, "ar") and not acc["drafted"]:
        acc["note"] = plain_note(strategy)
    return acc


def _speedup(pairs: list[tuple[dict, dict]], lossless: list[tuple[dict, dict]]) -> dict:
    """pairs: (the job's strategy row from the baseline pass, ar row) of the same id, both
    ok; lossless: (the job's own row, ar row)."""
    identical = sum(s["generated_tokens"] == a["generated_tokens"] for s, a in lossless)
    if not pairs:
        return {"rows": 0, "speedup": None, "decode_speedup": None,
                "identical_tokens": identical}
    spec, ar = throughput([p[0] for p in pairs]), throughput([p[1] for p in pairs])
    per_row = [s["tokens_per_s"] / a["tokens_per_s"] for s, a in pairs
               if s["tokens_per_s"] and a["tokens_per_s"]]
    speedup = _ratio(spec["tokens_per_s"], ar["tokens_per_s"])
    noise = {"note": NOISE_NOTE} if speedup is not None and not any(
        p[0]["drafted"] for p in pairs) else {}
    return {
        "rows": len(pairs),
        "speedup": speedup,
        **noise,
        "decode_speedup": _ratio(spec["decode_tokens_per_s"], ar["decode_tokens_per_s"]),
        "strategy_tokens_per_s": spec["tokens_per_s"],
        "ar_tokens_per_s": ar["tokens_per_s"],
        "strategy_mean_batch": spec["mean_batch"],
        "ar_mean_batch": ar["mean_batch"],
        "row_speedup_median": statistics.median(per_row) if per_row else None,
        "row_speedup_min": min(per_row) if per_row else None,
        "row_speedup_max": max(per_row) if per_row else None,
        "identical_tokens": identical,
    }


def summarize(rows: pa.Table, baseline: pa.Table, id_column: str, input_ids: list,
              job: dict, run: dict, again: pa.Table | None = None) -> dict:
    """The content of ``summary.json``; ``again``: the baseline rows run with the job's
    strategy in the baseline pass."""
    out = rows.to_pylist()
    base = {r[id_column]: r for r in baseline.to_pylist() if r["error"] is None}
    again_ok = {} if again is None else {r[id_column]: r for r in again.to_pylist()
                                         if r["error"] is None}
    ok = [r for r in out if r["error"] is None]
    failed = [r for r in out if r["error"] is not None]
    written = {r[id_column] for r in out}
    inputs = set(input_ids)
    errors: dict[str, int] = {}
    for r in failed:
        kind = error_kind(r["error"])
        errors[kind] = errors.get(kind, 0) + 1
    lossless = [(r, base[r[id_column]]) for r in ok if r[id_column] in base]
    pairs = [(again_ok[i], b) for i, b in base.items() if i in again_ok]
    buckets = []
    for lo, hi in zip(BUCKET_EDGES, BUCKET_EDGES[1:]):
        members = [r for r in out if r["num_input_tokens"] is not None
                   and lo <= r["num_input_tokens"] < hi]
        if not members:
            continue
        b_ok = [r for r in members if r["error"] is None]
        b_pairs = [p for p in pairs if lo <= p[0]["num_input_tokens"] < hi]
        b_lossless = [p for p in lossless if lo <= p[0]["num_input_tokens"] < hi]
        buckets.append({
            "bucket": _label(lo, hi), "min_tokens": lo, "max_tokens": None if hi == math.inf
            else hi, "rows": len(members), "ok": len(b_ok), "failed": len(members) - len(b_ok),
            "mean_input_tokens": statistics.fmean(r["num_input_tokens"] for r in members),
            "generated_tokens": sum(r["num_generated_tokens"] for r in b_ok),
            "row_tokens_per_s": _throughput(b_ok) if b_ok else None,
            **{k: v for k, v in _acceptance(b_ok).items()
               if k in ("acceptance_rate", "attention_skipped", "mlp_skipped")},
            "baseline": _speedup(b_pairs, b_lossless)})
    return {
        "job": job,
        "complete": inputs <= written,
        "rows": {"input": len(inputs), "written": len(out), "ok": len(ok),
                 "failed": len(failed), "pending": len(inputs - written),
                 "not_in_input": len(written - inputs)},
        "errors": errors,
        "tokens": {"input": sum(r["num_input_tokens"] or 0 for r in ok),
                   "generated": sum(r["num_generated_tokens"] for r in ok)},
        "row_tokens_per_s": _throughput(ok) if ok else None,
        "throughput": throughput(ok, run.get("max_num_seqs")),
        "generation_seconds": sum(r["time_taken_llm"] for r in ok),
        "acceptance": _acceptance_of_job(ok, job.get("strategy")),
        "plans": _plans(ok),
        "baseline": {"strategy": "ar", **_speedup(pairs, lossless)},
        "buckets": buckets,
        "run": run,
    }


def dumps(summary: dict) -> bytes:
    def default(o):
        if o == math.inf:
            return None
        return str(o)
    return json.dumps(summary, indent=2, default=default, allow_nan=False).encode() + b"\n"
