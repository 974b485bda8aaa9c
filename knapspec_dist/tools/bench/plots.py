"""The plots of ``knapspec bench`` and ``knapspec throughput``: the tools' one matplotlib
import, with the file-only Agg backend (no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen


def plot_bench(out: Path, rows: list[dict]) -> None:
    """``speedup.png`` (decode only and end to end, against ar) and ``skipped.png``
    (sublayers skipped per drafted token), against context length."""
    labels = list(dict.fromkeys(r["strategy"] for r in rows))
    contexts = sorted({r["context"] for r in rows})
    series = {label: sorted((r for r in rows if r["strategy"] == label),
                            key=lambda r: r["context"]) for label in labels}

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, title in ((axes[0], "decode_speedup", "decode only"),
                           (axes[1], "speedup", "end to end (prefill included)")):
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        for label in labels:
            if label == "ar":
                continue
            pts = series[label]
            ax.plot([r["context"] for r in pts], [r[key] for r in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup vs ar")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, label in enumerate(x for x in labels if x != "ar"):
        pts, c = series[label], colors[k % len(colors)]
        xs = [r["context"] for r in pts]
        ax.plot(xs, [r["attention_skipped"] for r in pts], marker="o", color=c,
                label=f"{label}: attention")
        ax.plot(xs, [r["mlp_skipped"] for r in pts], marker="s", linestyle="--", color=c,
                label=f"{label}: MLP")
    ax.set_ylabel("sublayers skipped per drafted token")
    _context_axis(ax, contexts)
    _save(fig, out / "skipped.png")


def plot_throughput(path: Path, runs: list[dict]) -> None:
    """``throughput.png``: tokens/s against max_num_seqs, one line per strategy, context and
    draw (greedy or sampled)."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for key in dict.fromkeys((r["strategy"], r["context"], r.get("draw", "greedy"))
                             for r in runs):
        pts = sorted((r for r in runs
                      if (r["strategy"], r["context"], r.get("draw", "greedy")) == key),
                     key=lambda r: r["batch"])
        label, n, draw = key
        ax.plot([r["batch"] for r in pts], [r["tokens_per_s"] for r in pts], marker="o",
                label=f"{label}, context {n}, {draw}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_num_seqs")
    ax.set_ylabel("tokens/s (prefill included)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_findings(path: Path, findings: list[dict]) -> None:
    """``findings.png``: (a) the attention and MLP shares ``knapspec:paper`` skips, and
    (b)-(d) its decode rate over each ablation's (and against ar), per context."""
    contexts = [f["context"] for f in findings]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    ax.plot(contexts, [f["attention_share"] for f in findings], marker="o", label="attention")
    ax.plot(contexts, [f["mlp_share"] for f in findings], marker="s", label="MLP")
    ax.set_ylabel("share of sublayers skipped per drafted token")
    ax.set_title("(a) knapspec:paper's subnets")
    ax = axes[1]
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    for key, label in (("paper_over_b", "(b) paper / coupled"), ("paper_over_c",
                       "(c) paper / alpha objective"), ("paper_over_d", "(d) paper / select-once"),
                       ("paper_vs_ar", "paper / ar"), ("default_vs_ar", "knapspec / ar")):
        pts = [(f["context"], f[key]) for f in findings if f[key] is not None]
        ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=label,
                linestyle="--" if "ar" in key else "-")
    ax.set_ylabel("decode tokens/s ratio")
    ax.set_title("(b)-(d) against the ablations")
    for ax in axes:
        _context_axis(ax, contexts)
    _save(fig, path)


def _context_axis(ax, contexts: list[int]) -> None:
    """Context lengths on a log-2 x axis, a grid and the legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.set_xlabel("context length (tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
