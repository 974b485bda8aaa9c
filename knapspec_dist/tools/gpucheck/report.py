"""gpu-check's outputs: the JSON document as is, and markdown tables of it (the .md file and
the command's final report). Skipped rows keep their reason in the status column."""

from __future__ import annotations

import json
from pathlib import Path

from knapspec_dist.tools.gpucheck.batched import table as batched_table
from knapspec_dist.tools.gpucheck.bf16 import SAMPLED
from knapspec_dist.tools.gpucheck.findings import markdown as findings_markdown


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {n}" for k, n in v.items())
    return str(v)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    if not rows:
        return ["(none)"]
    lines = ["| " + " | ".join(title for _, title in columns) + " |",
             "|" + "|".join(" --- " for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(key)) for key, _ in columns) + " |")
    return lines


SECTIONS = [
    ("decode", "Decode step vs memory bound", [
        ("model", "model"), ("context", "context"), ("batch", "batch"), ("backend", "backend"),
        ("ms", "step ms"), ("bound_ms", "bound ms"), ("ratio", "ratio"),
        ("tb_per_s", "TB/s"), ("status", "status")]),
    ("verify", "Verify(q) / decode (batch 1)", [
        ("model", "model"), ("context", "context"), ("q", "q"), ("ms", "verify ms"),
        ("decode_ms", "decode ms"), ("ratio", "ratio"), ("status", "status")]),
    ("draft", "Draft step vs bytes skipped (batch 1)", [
        ("model", "model"), ("context", "context"), ("skip_set", "skip set"),
        ("skipped", "sublayers"), ("ms", "draft ms (plan graph)"), ("time_ratio", "time ratio"),
        ("bytes_ratio", "bytes ratio"), ("capture_ms", "capture ms"), ("status", "status")]),
    ("captures", "Per-plan draft graph capture", [
        ("model", "model"), ("context", "context"), ("draft_captures", "draft captures"),
        ("runner_captures", "runner.captures"), ("ms_per_capture", "ms per capture"),
        ("status", "status")]),
]
LATE = [
    ("paged", "Paged KV against fixed slots (replayed forward of T tokens a row, equal batch)", [
        ("model", "model"), ("context", "context"), ("batch", "batch"), ("t", "T"),
        ("page", "page"), ("fixed_ms", "fixed ms"), ("paged_ms", "paged ms"),
        ("ratio", "paged / fixed"), ("status", "status")]),
    ("paged_identity", "Paged against fixed slots as long as the pool, fp32 logits", [
        ("model", "model"), ("context", "context"), ("batch", "batch"), ("t", "T"),
        ("identical", "same bits"), ("max_diff", "max diff"),
        ("pool_positions", "pool positions"), ("status", "status")]),
    ("backends", "Attention backend A/B (decode, batch 1)", [
        ("model", "model"), ("context", "context"), ("backend", "backend"), ("ms", "step ms"),
        ("vs_default", "vs default"), ("status", "status")]),
    ("early_exit", "Drafting's early exit: one read-back per draft token (batch 1)", [
        ("model", "model"), ("context", "context"), ("no_exit_ms", "draft ms, no exit"),
        ("exit_ms", "draft ms, exit"), ("readback_us", "read-back us"),
        ("share", "of a draft step"), ("status", "status")]),
    ("block_mask", "Block mask with / without q indices (compute_q_blocks)", [
        ("model", "model"), ("context", "context"), ("ops_with_q", "ops with q"),
        ("ops_without_q", "ops without"), ("us_with_q", "us with q"),
        ("us_without_q", "us without"), ("supported", "torch takes it"), ("status", "status")]),
    ("pieces", "Draft step from per-sublayer graph pieces (batch 1)", [
        ("model", "model"), ("context", "context"), ("skip_set", "skip set"),
        ("skipped", "sublayers"), ("ms", "draft ms (pieces)"), ("plan_ms", "plan graph ms"),
        ("vs_plan", "vs plan graph"), ("first_call_ms", "first call ms"), ("status", "status")]),
]
RUN = [("section", "section"), ("status", "status"), ("wall_s", "wall s"),
       ("budget_s", "budget s"), ("compiles", "compiles"), ("compile_s", "compile s"),
       ("rows_ok", "rows ok"), ("rows_failed", "failed"), ("rows_skipped", "skipped"),
       ("cut", "cut for time")]

GREEDY = [("dtype", "dtype"), ("guarantee", "what holds"), ("strategy", "strategy"),
          ("prompt", "prompt"),
          ("new_tokens", "tokens"), ("acceptance", "acceptance"), ("verdict", "vs ar"),
          ("detail", "first divergence"), ("status", "status")]
SPREAD = [("dtype", "dtype"), ("prompt", "prompt"), ("positions", "positions"),
          ("median", "median ulps"), ("p90", "p90"), ("max", "max"),
          ("bound_ulps", "bound ulps"), ("fits", "2 x max <= bound"), ("status", "status")]
SAMPLING = [("strategy", "strategy"), ("dtype", "dtype"), ("new_tokens", "tokens"),
            ("tokens_per_s", "tok/s"), ("acceptance", "acceptance"), ("in_vocab", "in vocab"),
            ("repeats", "same seed, same tokens"), ("status", "status")]
REJECTION = [("skip_set", "skip set"), ("prompt", "prompt"), ("method", "sampling"),
             ("new_tokens", "tokens"), ("acceptance", "acceptance"),
             ("tokens_per_round", "tokens/round"), ("tokens_per_s", "tok/s"),
             ("outside_support", "outside top-p"), ("max_mass_above", "max mass above"),
             ("status", "status")]
RATIOS = [("skip_set", "skip set"), ("coupled_acceptance", "acceptance, coupled"),
          ("rejection_acceptance", "acceptance, rejection"),
          ("acceptance_ratio", "rejection / coupled"),
          ("tokens_per_round_ratio", "tokens/round, rejection / coupled"),
          ("tokens_per_s_ratio", "tok/s, rejection / coupled")]
BATCH_SPREAD = [("batch", "batch"), ("positions", "positions"), ("median", "median ulps"),
                ("p90", "p90"), ("max", "max"), ("max_row0", "max, document 0"),
                ("bound_ulps", "bound ulps"), ("fits", "2 x max <= bound"), ("status", "status")]
BENCH = [("context", "context"), ("strategy", "strategy"), ("prompts", "prompts"),
         ("tokens_per_s", "tok/s"), ("speedup", "speedup vs ar"), ("acceptance", "acceptance"),
         ("verdicts", "vs ar")]


def markdown(doc: dict) -> str:
    meta = doc["meta"]
    lines = [f"# knapspec gpu-check ({meta['device_name']})", "", meta["headline"], "",
             f"`{meta['command']}` on {meta['date']}, torch {meta['torch']}, "
             f"{'quick (tiny shapes)' if meta['quick'] else 'full'}; {meta['wall_s']:.0f} s of a "
             f"{meta['budget_s']:.0f} s budget ({meta.get('setup_s', 0.0):.0f} s of imports and "
             f"model conversion before the first section). "
             f"Bound = (weight bytes + KV bytes read) / {meta['bandwidth_tb_s']} TB/s; "
             f"shapes in {meta['dtype']} with random weights.", ""]
    if meta.get("stopped"):
        lines += [f"**Stopped early: {meta['stopped']}.**", ""]
    kernels = doc.get("kernels", [])
    if kernels:
        lines += ["## Decode attention kernel per shape", "", *(f"- {k['line']}" for k in kernels),
                  ""]
    run = [{"section": name, **r} for name, r in doc["sections"].items()]
    lines += ["## Sections (in the order run; compiles: graphs torch.compile made)", "",
              *table(run, RUN), ""]
    for key, title, columns in SECTIONS + LATE:
        lines += [f"## {title}", "", *table(doc[key], columns), ""]
    c = doc["correctness"]
    lines += [f"## Correctness ({c.get('model', '-')})", "", *table(c["greedy"], GREEDY), "",
              "Logit spread, decode and verify against one forward (the near-tie bound must "
              "cover twice it):", "", *table(c.get("spread", []), SPREAD), "",
              "Sampling (temperature 0.8, top-p 0.95, seed 0):", "",
              *table(c["sampling"], SAMPLING), ""]
    f = doc.get("bf16", {"rejection": [], "summary": [], "spread": [], "notes": []})
    lines += [f"## bf16: rejection sampling against the coupling, the spread by batch "
              f"({f.get('model', '-')})", "",
              f"Sampled T {SAMPLED['temperature']}, top-p {SAMPLED['top_p']}, seed "
              f"{SAMPLED['seed']}, static subnets; every token checked against the top-p support "
              "of one forward:", "", *table(f["rejection"], REJECTION), "",
              *table(f["summary"], RATIOS), "",
              "Logit spread with B rows decoded together, decode and verify against one "
              "forward:", "", *table(f["spread"], BATCH_SPREAD), ""]
    b = doc["bench"]
    lines += [f"## Long documents ({b.get('model', '-')}, bf16)", "", *table(b["summary"], BENCH),
              ""]
    bt = doc.get("batched", {"runs": [], "notes": []})
    lines += [f"## Continuous batching, ar vs knapspec ({bt.get('model', '-')}, bf16)", "",
              *batched_table(bt), ""]
    fd = doc.get("findings", {"runs": [], "notes": []})
    lines += [f"## The paper's findings: knapspec:paper and its ablations "
              f"({fd.get('model', '-')}, bf16)", "", *findings_markdown(fd), ""]
    unmeasured = [f"bench {r['strategy']} at context {r['context']} ({r['prompt']}): "
                  f"{r['status']}" for r in b["runs"] if r["status"] != "ok"]
    notes = (doc["notes"] + c["notes"] + f["notes"] + b["notes"] + unmeasured + bt["notes"]
             + fd["notes"])
    if notes:
        lines += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)


def write_json(out: Path, doc: dict) -> Path:
    """gpu-check.json, replaced whole (a reader never sees half a file): after every row."""
    out.mkdir(parents=True, exist_ok=True)
    js, tmp = out / "gpu-check.json", out / "gpu-check.json.tmp"
    tmp.write_text(json.dumps(doc, default=str))
    tmp.replace(js)
    return js


def write(out: Path, doc: dict) -> tuple[Path, Path, str]:
    """gpu-check.json and gpu-check.md: after every section."""
    js = write_json(out, doc)
    text = markdown(doc)
    md = out / "gpu-check.md"
    md.write_text(text)
    return js, md, text
