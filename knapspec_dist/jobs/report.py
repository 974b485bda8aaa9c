"""The few lines a finished job shows its user: what happened and where the results are."""

from __future__ import annotations

from knapspec_dist.jobs.runner import JobResult
from knapspec_dist.ratio import shown


def report(result: JobResult) -> str:
    """A few lines for the user: what happened and where the results are."""
    s = result.summary
    rows, base = s["rows"], s["baseline"]
    lines = [
        f"rows: {rows['ok']} ok, {rows['failed']} failed, {rows['pending']} pending "
        f"(of {rows['input']}; this run generated {result.generated}, "
        f"skipped {result.skipped} already written)",
    ]
    throughput = s["throughput"]
    if throughput["tokens_per_s"]:
        acc = s["acceptance"]["acceptance_rate"]
        lines.append(f"tokens: {s['tokens']['generated']} generated, "
                     f"{throughput['tokens_per_s']:.1f} tok/s "
                     f"({shown(throughput['decode_tokens_per_s'], '.1f')} without prefill), "
                     f"mean batch {shown(throughput['mean_batch'], '.1f')} of "
                     f"{throughput['max_num_seqs']}"
                     + (f", acceptance {acc:.2f}" if acc is not None else ""))
    kv = s.get("kv_cache")
    if kv:
        pool = (f"{kv['pages']} pages of {kv['page_size']}" if kv["paged"]
                else f"{kv['pages']} fixed slots of {kv['page_size']}")
        lines.append(f"KV cache: {kv['tokens']} tokens per rank ({pool}, "
                     f"{kv['bytes'] / 2 ** 30:.2f} GiB), peak {kv['peak_use']:.0%}; rows in "
                     f"flight {kv['mean_rows']:.1f} mean, {kv['peak_rows']} peak; "
                     f"{kv['memory_wait_s']:.1f}s waiting for memory")
    sources = s["acceptance"].get("by_source")
    if sources and s["acceptance"]["drafted"]:
        lines.append("drafts: " + "; ".join(
            f"{name} {src['accepted']} of {src['drafted']} kept"
            for name, src in sources.items() if src["drafted"]))
    if s["acceptance"].get("note"):
        lines.append(s["acceptance"]["note"])
    if (s.get("job") or {}).get("reproducible_note"):
        lines.append(s["job"]["reproducible_note"])
    if base["speedup"]:
        note = f" ({base['note']})" if base.get("note") else ""
        lines.append(f"speedup vs ar: {base['speedup']:.2f}x{note}, measured on {base['rows']} "
                     f"baseline row(s), both passes at mean batch "
                     f"{shown(base['strategy_mean_batch'], '.1f')} / "
                     f"{shown(base['ar_mean_batch'], '.1f')} "
                     f"(identical tokens: {base['identical_tokens']}/{base['rows']})")
    if result.replicas_lost:
        lines.append(f"{result.replicas_lost} replica(s) lost (they could not restart: a node "
                     "gone?); the other replicas ran their rows")
    if result.stopped_early:
        lines.append("stopped early (--stop-after): submit the same job again to continue")
    lines += [f"results: {result.rows_path}", f"summary: {result.summary_path}",
              f"plot:    {result.plot_path}"]
    return "\n".join(lines)
