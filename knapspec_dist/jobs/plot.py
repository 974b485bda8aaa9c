"""``speedup.png``: speedup and acceptance by context length, from the summary and the rows.

The only module of the package that imports matplotlib (with its file-only Agg backend).
"""

from __future__ import annotations

import io
from typing import Callable

import matplotlib
import pyarrow as pa

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import matplotlib.ticker  # noqa: E402


def write_plot(summary: dict, rows: pa.Table, baseline: pa.Table, id_column: str,
               write_bytes: Callable[[bytes], None], again: pa.Table | None = None) -> None:
    """``speedup.png``: speedup (baseline rows: the strategy's baseline pass against ar's)
    and acceptance by context length."""
    out = [r for r in rows.to_pylist() if r["error"] is None]
    base = {r[id_column]: r for r in baseline.to_pylist() if r["error"] is None}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    rerun = [] if again is None else [r for r in again.to_pylist() if r["error"] is None]
    xs = [r["num_input_tokens"] for r in rerun if r[id_column] in base
          and r["tokens_per_s"] and base[r[id_column]]["tokens_per_s"]]
    ys = [r["tokens_per_s"] / base[r[id_column]]["tokens_per_s"] for r in rerun
          if r[id_column] in base and r["tokens_per_s"] and base[r[id_column]]["tokens_per_s"]]
    ax1.scatter(xs, ys, s=24, alpha=0.7, label="baseline rows")
    bx = [b["mean_input_tokens"] for b in summary["buckets"] if b["baseline"]["speedup"]]
    by = [b["baseline"]["speedup"] for b in summary["buckets"] if b["baseline"]["speedup"]]
    ax1.plot(bx, by, "s-", color="C1", label="per length bucket")
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    sp = summary["baseline"]
    title = (f"speedup vs ar: {sp['speedup']:.2f}x on {sp['rows']} row(s)" if sp["speedup"]
             else "speedup vs ar: no baseline rows")
    ax1.set_title(f"{summary['job'].get('strategy')} on {summary['job'].get('model')}: {title}")
    ax1.set_ylabel("speedup (tokens/s ratio)")
    ax1.legend(loc="best", fontsize=8)
    drafting = [r for r in out if r["drafted"]]  # acceptance is undefined without drafts
    ax2.scatter([r["num_input_tokens"] for r in drafting],
                [r["acceptance_rate"] for r in drafting], s=16, alpha=0.6, label="rows")
    ax2.plot([b["mean_input_tokens"] for b in summary["buckets"]
              if b["acceptance_rate"] is not None],
             [b["acceptance_rate"] for b in summary["buckets"] if b["acceptance_rate"] is not None],
             "s-", color="C1", label="per length bucket")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_ylabel("draft acceptance rate")
    ax2.set_xlabel("prompt tokens")
    ax2.legend(loc="best", fontsize=8)
    if not drafting:
        ax2.text(0.5, 0.5, "no drafted tokens", transform=ax2.transAxes, ha="center",
                 color="grey")
    lengths = [r["num_input_tokens"] for r in out if r["num_input_tokens"]]
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
