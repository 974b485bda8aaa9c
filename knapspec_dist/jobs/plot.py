"""``speedup.png``: what the job measured, by prompt length, from the summary and the rows.

Top: every ok row of the main pass, its tokens per second (``tokens_per_s``: the row's
generated tokens over its own wall time) against its prompt length, with the baseline
pair(s) marked: the same row in the strategy's baseline pass and in ``ar``'s, joined by a
line, and the measured speedup (labelled as noise when both passes decoded plainly) in the
title.  Bottom: draft acceptance by prompt length, per source: drafts copied from the row's own
tokens and drafts of a subnet, each row's rate over the tokens it drafted from that source.
:func:`plot_data` is what is drawn.

The only module of the package that imports matplotlib (with its file-only Agg backend).
"""

from __future__ import annotations

import io
from typing import Callable

import matplotlib
import pyarrow as pa
import pyarrow.compute as pc

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import matplotlib.ticker  # noqa: E402

from knapspec_dist.jobs.summary import column_or_nulls  # noqa: E402

#: The main pass's columns the plot reads (a point per ok row).
PLOT_COLUMNS = ["num_input_tokens", "tokens_per_s", "acceptance_rate", "drafted", "accepted",
                "copied_drafted", "copied_accepted", "error"]
#: Where drafts come from (speculation/lookup.py copies, a subnet's forwards), as drawn.
SOURCES = {"copied": "copied from the row", "subnet": "from a subnet"}
#: Points drawn per series at most: past that a scatter is a blot, so every k-th row is drawn
#: (the table is filtered with Arrow: a million rows never become a million Python objects).
MAX_POINTS = 20_000


def _points(table: pa.Table, y: str, where: pa.ChunkedArray) -> list[tuple]:
    """(prompt tokens, ``y``) of the ok rows with a prompt length, a ``y`` and ``where``; at
    most MAX_POINTS, evenly spaced over the table's order."""
    n = "num_input_tokens"
    keep = pc.and_kleene(pc.and_kleene(pc.is_null(table["error"]), pc.greater(table[n], 0)),
                         pc.and_kleene(pc.is_valid(table[y]), where))
    kept = table.select([n, y]).filter(pc.fill_null(keep, False))
    if kept.num_rows > MAX_POINTS:
        kept = kept.take(pa.array(range(0, kept.num_rows, -(-kept.num_rows // MAX_POINTS))))
    return list(zip(kept[n].to_pylist(), kept[y].to_pylist()))


def _counts(table: pa.Table, name: str) -> pa.ChunkedArray:
    """A count column, 0 where the row or the table lacks it (a part of an older version)."""
    return pc.fill_null(column_or_nulls(table, name), 0)


def _by_source(table: pa.Table) -> dict[str, list[tuple]]:
    """source -> [(prompt tokens, acceptance of that source's drafts)] of the ok rows that
    drafted from it: copied accepted / copied drafted, and the rest (a subnet's)."""
    drafted, accepted = _counts(table, "drafted"), _counts(table, "accepted")
    copied, kept = _counts(table, "copied_drafted"), _counts(table, "copied_accepted")
    subnet = pc.subtract(drafted, copied)
    rates = table.select(["num_input_tokens", "error"]).append_column(
        "copied", pc.divide(pc.cast(kept, pa.float64()), pc.cast(copied, pa.float64()))
    ).append_column("subnet", pc.divide(pc.cast(pc.subtract(accepted, kept), pa.float64()),
                                        pc.cast(subnet, pa.float64())))
    return {"copied": _points(rates, "copied", pc.greater(copied, 0)),
            "subnet": _points(rates, "subnet", pc.greater(subnet, 0))}


def plot_data(summary: dict, rows: pa.Table, baseline: pa.Table, id_column: str,
              again: pa.Table | None = None) -> dict:
    """The series of ``speedup.png``: ``rows`` [(prompt tokens, tokens/s)] per ok main-pass
    row (at most MAX_POINTS); ``pairs`` [(prompt tokens, strategy tokens/s, ar tokens/s)] per
    baseline row ok in both baseline passes; ``acceptance`` {source: [(prompt tokens, rate)]}
    per row that drafted from that source (``SOURCES``); the per-bucket
    ``acceptance_buckets``; and the ``title``."""
    points = _points(rows, "tokens_per_s", pc.not_equal(rows["tokens_per_s"], 0))
    acceptance = _by_source(rows)
    base = {r[id_column]: r for r in baseline.to_pylist() if r["error"] is None}
    rerun = [] if again is None else [r for r in again.to_pylist() if r["error"] is None]
    pairs = [(r["num_input_tokens"], r["tokens_per_s"], base[r[id_column]]["tokens_per_s"])
             for r in rerun if r[id_column] in base and r["num_input_tokens"]
             and r["tokens_per_s"] and base[r[id_column]]["tokens_per_s"]]
    sp = summary["baseline"]
    if sp["speedup"]:
        title = f"speedup vs ar: {sp['speedup']:.2f}x on {sp['rows']} row(s)"
        if sp.get("note"):
            title += "\n(both passes decoded plainly: run-to-run noise, not a speedup)"
    else:
        title = "speedup vs ar: no baseline rows"
    job = summary["job"]
    return {
        "rows": points,
        "pairs": pairs,
        "acceptance": acceptance,
        "acceptance_buckets": [(b["mean_input_tokens"], b["acceptance_rate"])
                               for b in summary["buckets"] if b["acceptance_rate"] is not None],
        "title": f"{job.get('strategy')} on {job.get('model')}: {title}",
        "strategy": job.get("strategy"),
        "note": summary["acceptance"].get("note"),
    }


def write_plot(summary: dict, rows: pa.Table, baseline: pa.Table, id_column: str,
               write_bytes: Callable[[bytes], None], again: pa.Table | None = None) -> dict:
    """Draw :func:`plot_data` into ``speedup.png`` (through ``write_bytes``); returns the
    data drawn."""
    data = plot_data(summary, rows, baseline, id_column, again)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    if data["rows"]:
        ax1.scatter(*zip(*data["rows"]), s=18, alpha=0.6, color="C0",
                    label=f"rows, main pass ({data['strategy']})")
    for i, (n, spec, ar) in enumerate(data["pairs"]):
        ax1.plot([n, n], [spec, ar], color="grey", lw=0.8)
        ax1.scatter([n], [spec], marker="^", s=60, color="C2", zorder=3,
                    label=f"baseline pass, {data['strategy']}" if i == 0 else None)
        ax1.scatter([n], [ar], marker="v", s=60, color="C3", zorder=3,
                    label="baseline pass, ar" if i == 0 else None)
    ax1.set_title(data["title"], fontsize=10)
    ax1.set_ylabel("tokens/s per row")
    rates = [y for _, y in data["rows"]] + [y for p in data["pairs"] for y in p[1:]]
    ax1.set_ylim(0, max(rates) * 1.15 if rates else 1)  # room for the markers
    if data["rows"] or data["pairs"]:
        ax1.legend(loc="best", fontsize=8)
    else:
        ax1.text(0.5, 0.5, "no rows generated", transform=ax1.transAxes, ha="center",
                 color="grey")
    drew = False
    for color, (source, points) in zip(("C4", "C0"), data["acceptance"].items()):
        if points:
            ax2.scatter(*zip(*points), s=16, alpha=0.6, color=color,
                        label=f"rows, drafts {SOURCES[source]}")
            drew = True
    if data["acceptance_buckets"]:
        ax2.plot(*zip(*data["acceptance_buckets"]), "s-", color="C1",
                 label="per length bucket, all drafts")
    if drew or data["acceptance_buckets"]:
        ax2.legend(loc="best", fontsize=8)
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_ylabel("draft acceptance rate")
    ax2.set_xlabel("prompt tokens")
    if not drew:
        ax2.text(0.5, 0.5, data["note"] or "no drafted tokens", transform=ax2.transAxes,
                 ha="center", color="grey", fontsize=9, wrap=True)
    lengths = [n for n, _ in data["rows"]] + [n for n, _, _ in data["pairs"]]
    if lengths:  # all panels share the x axis: the prompt lengths of the rows
        ax2.set_xscale("log", base=2)
        ax2.set_xlim(min(lengths) / 1.25, max(lengths) * 1.25)
        ax2.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes(buf.getvalue())
    return data
