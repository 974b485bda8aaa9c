"""Results of a bench run: per-(context, strategy) summary, the Markdown tables, the
machine and the command line that repeats it (the plots: plots.py).

Per plan (``stats.plans``, engine/generation.py ``PlanTally``) the report gives, for each
strategy whose selection priced its plans (knapspec's, clasp), the ``PLANS_SHOWN`` plans with
the most seconds and the rest as "other": rounds, tokens, realized tokens per second (over the
rounds' draft and verify seconds) next to the predicted (what the selection priced it at)."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

import torch

from knapspec_dist.engine.generation import add_plans, ranked_plans
from knapspec_dist.engine.sampling import SamplingConfig
from knapspec_dist.profiles.device import cpu_model_name
from knapspec_dist.ratio import ratio, shown

PLANS_SHOWN = 4  # plans per context and strategy in results.md, the rest as "other"


def plans_of(stats: list[dict]) -> list[dict]:
    """The runs' per-plan tallies, summed and ranked (engine/generation.py ``ranked_plans``);
    none where no plan was priced (a strategy without a selection: nothing to compare)."""
    sums: dict[str, dict] = {}
    add_plans(sums, ([{"plan": label, **t} for label, t in (s.get("plans") or {}).items()]
                     for s in stats))
    if not any(acc["priced_s"] for acc in sums.values()):
        return []
    return ranked_plans(sums, PLANS_SHOWN)


def summarize(runs: list[dict]) -> list[dict]:
    """Per (context, strategy): rates summed over prompts, speedups against ar."""
    rows = []
    keys = list(dict.fromkeys((r["context"], r["strategy"]) for r in runs))
    for n, label in keys:
        mine = [r["stats"] for r in runs if r["context"] == n and r["strategy"] == label]
        new = sum(s["new_tokens"] for s in mine)
        wall = sum(s["wall_s"] for s in mine)
        decode = sum(s["wall_s"] - s["prefill_s"] for s in mine)
        drafted = sum(s["drafted"] for s in mine)
        rows.append({
            "context": n, "strategy": label, "runs": len(mine),
            "prompt_tokens": sum(s["prompt_tokens"] for s in mine) / len(mine),
            "new_tokens": new,
            "tokens_per_s": _tokens_per_s(mine),
            "decode_tokens_per_s": ratio(new - len(mine), decode),
            "acceptance": ratio(sum(s["accepted"] for s in mine), drafted),
            # tokens per decode or verify round (the first token comes from the prefill)
            "tokens_per_round": ratio(new - len(mine), sum(s.get("rounds", 0) for s in mine)),
            "attention_skipped": (sum(s["attention_skipped"] * s["drafted"] for s in mine)
                                  / drafted if drafted else 0.0),
            "mlp_skipped": (sum(s["mlp_skipped"] * s["drafted"] for s in mine) / drafted
                            if drafted else 0.0),
            "selection_pct": 100 * sum(s["select_s"] for s in mine) / wall if wall else 0.0,
            "selections": sum(s["selections"] for s in mine),
            "fallbacks": sum(s.get("fallbacks", 0) for s in mine),
            "draft_s": sum(s["draft_s"] for s in mine),
            "verify_s": sum(s["verify_s"] for s in mine),
            "plans": plans_of(mine),
            # None: not compared (rejection sampling: the distribution, not the tokens)
            "matches_ar": _all_match(r["matches_ar"] for r in runs
                                     if r["context"] == n and r["strategy"] == label),
            "ties": sum(1 for r in runs if r["context"] == n and r["strategy"] == label
                        and _verdict(r) == "tie"),
            "bugs": sum(1 for r in runs if r["context"] == n and r["strategy"] == label
                        and _verdict(r) not in (None, "tie")),
            **_check_totals([r["check"] for r in runs
                             if r["context"] == n and r["strategy"] == label]),
        })
    for row in rows:
        ar = next(r for r in rows if r["context"] == row["context"] and r["strategy"] == "ar")
        row["speedup"] = ratio(row["tokens_per_s"], ar["tokens_per_s"])
        row["decode_speedup"] = ratio(row["decode_tokens_per_s"], ar["decode_tokens_per_s"])
        row["repeat_speedups"] = _repeat_speedups(runs, row["context"], row["strategy"])
    return rows


def _tokens_per_s(stats: list[dict]) -> float | None:
    """New tokens over wall seconds, prefill included, of runs summed."""
    return ratio(sum(s["new_tokens"] for s in stats), sum(s["wall_s"] for s in stats))


def _repeat_speedups(runs: list[dict], n: int, label: str) -> list[float]:
    """End-to-end speedup against ar per repeat (each over all prompts of the context): how
    far one repeat moves from another on this machine. Empty for a single repeat."""
    reps = sorted({r.get("repeat", 0) for r in runs if r["context"] == n})
    if len(reps) < 2:
        return []

    def rate(strategy: str, rep: int) -> float | None:
        return _tokens_per_s([r["stats"] for r in runs if r["context"] == n
                              and r["strategy"] == strategy and r.get("repeat", 0) == rep])
    return [ratio(rate(label, k), rate("ar", k)) for k in reps]


def _check_totals(checks: list[dict | None]) -> dict:
    """The runs' checks against ar summed: tokens compared, near-ties (per 1,000 tokens) and
    the bound's false-acceptance rate (the share of positions whose runner-up is inside it).
    Runs not compared (None) add nothing."""
    checks = [c for c in checks if c is not None]
    tokens = sum(c["tokens"] for c in checks)
    near = sum(c["ties"] for c in checks)
    return {"tokens_checked": tokens, "near_ties": near,
            "near_ties_per_1k": 1000.0 * near / tokens if tokens else 0.0,
            "false_acceptance": (sum(c["inside_bound"] for c in checks) / tokens
                                 if tokens else 0.0)}


def _all_match(matches) -> bool | None:
    values = list(matches)
    return None if None in values else all(values)


def _verdict(run: dict) -> str | None:
    """None: same tokens as ar, or not compared; "tie" when every divergence is a near-tie;
    else "BUG"."""
    if run["check"] is None or not run["check"]["divergences"]:
        return None
    return "tie" if run["check"]["correct"] else "BUG"


def _same_tokens(row: dict) -> str:
    if row["matches_ar"] is None:
        return "not compared"
    if row["bugs"]:
        return f"**NO: {row['bugs']} BUG**"
    if row["ties"]:
        return f"near-tie in {row['ties']}/{row['runs']}"
    return "yes"


def check_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per context and strategy, the tokens compared with ar, the near-ties
    among them and the bound's false-acceptance rate."""
    lines = ["## the check against ar", "",
             "Every token is compared with ar's; after a near-tie the strategy runs again from "
             "ar's token and the comparison goes on (knapspec_dist/tools/ties.py `check_run`). "
             "False acceptance: the share of positions where the full model's runner-up lies "
             "within the near-tie tolerance of its top logit, i.e. the chance that a bug "
             "emitting the runner-up there would be called a tie (0 where the rule is "
             "identity).", "",
             "| context | strategy | tokens compared | near-ties | per 1k tokens | "
             "false acceptance |", "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['strategy']} | {r['tokens_checked']} | "
                     f"{r['near_ties']} | {r['near_ties_per_1k']:.2f} | "
                     f"{100 * r['false_acceptance']:.2f} % |")
    return lines + [""]


def divergence_table(runs: list[dict]) -> list[str]:
    """Markdown lines: one row per divergence from ar (every one of every run compared), with
    its margin and near-tie classification."""
    bad = [(r, d) for r in runs if r["check"] is not None for d in r["check"]["divergences"]]
    if not bad:
        return []
    lines = ["## divergences from ar", "",
             "At each differing new token, the full model's logits of ar's tokens (one "
             "forward) give the logits of ar's token and the strategy's; gap = top logit - the "
             "lower of the two, margin = tolerance - gap. A near-tie (gap <= tolerance: steps "
             "of the model's dtype at the top logit, per dtype and device in "
             "knapspec_dist/model/precision.py, e.g. 14 in bf16 on a CPU, 1.75 for logits in "
             "[16, 32); 0 in fp32 on a CPU) is kernel rounding; anything else is a BUG "
             "(knapspec_dist/tools/ties.py).", "",
             "| context | prompt | strategy | repeat | new token | ar token (logit) "
             "| its token (logit) | top logit | gap | tolerance | margin | verdict |",
             "|---:|---|---|---:|---:|---|---|---:|---:|---:|---:|:---:|"]

    def tok(t, z):
        return "end" if t is None else f"{t} ({shown(z, '.4g')})"

    for r, d in bad:
        margin = None if d["gap"] is None else d["tolerance"] - d["gap"]
        lines.append(
            f"| {r['context']} | {r['prompt']} | {r['strategy']} | {r.get('repeat', 0) + 1} | "
            f"{d['position']} | {tok(d['reference_token'], d['reference_logit'])} | "
            f"{tok(d['candidate_token'], d['candidate_logit'])} | "
            f"{shown(d['top_logit'], '.4g')} | {shown(d['gap'], '.4g')} | "
            f"{shown(d['tolerance'], '.4g')} | {shown(margin, '.4g')} | "
            f"{'tie' if d['verdict'] == 'tie' else '**BUG**'} |")
    return lines + [""]


def sampling_line(sampling: dict | None) -> str:
    """How a run drew its tokens (``asdict`` of its SamplingConfig; None: greedy), and what
    that says of its tokens against ``ar``'s."""
    cfg = SamplingConfig(**(sampling or {}))
    if cfg.greedy:
        return "greedy"
    return cfg.label + (" (the tokens of plain sampling: checked against ar)"
                        if cfg.identical_to_plain else
                        " (plain sampling's distribution, not its tokens: not compared with ar)")


def machine(device: str) -> dict:
    info = {"cpu": cpu_model_name(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def command_line(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The command that repeats this run, every option spelled out: the subcommand's own
    program name (``knapspec bench``, ``knapspec throughput``, or the standalone entry's)."""
    words = shlex.split(parser.prog)
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        value = getattr(args, action.dest, None)
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                words.append(flag)
        elif value is not None:
            words += [flag, str(value)]
    return shlex.join(words)


def write_markdown(path: Path, header: dict, rows: list[dict], runs: list[dict]) -> None:
    m = header["machine"]
    machine_line = f"{m['cpu']}, {m['torch_threads']} torch threads ({m['cpu_count']} CPUs)"
    if m.get("gpu"):
        machine_line += f", GPU {m['gpu']}"
    lines = [
        "# knapspec bench", "",
        f"- command: `{header['command']}`",
        f"- machine: {machine_line}",
        f"- date: {header['date']}",
        f"- torch {header['torch']}, model {header['model']} ({header['dtype']}, "
        f"{header['device']}), {sampling_line(header.get('sampling'))}, "
        f"{header['new_tokens']} new tokens, "
        f"{header['prompts']} prompt(s) per context"
        + (f", {header['repeats']} repeats each (interleaved; rates over all)"
           if header.get("repeats", 1) > 1 else ""),
        "",
        "tok/s: new tokens / wall seconds, prefill included; decode tok/s: tokens after the "
        "first / seconds after prefill (the part strategies change). Speedups are against "
        "`ar` on the same prompts. Skipped: mean attention / MLP sublayers skipped per drafted "
        "token. Selection: select_s / wall_s; selections (fallbacks): subnet selections run, "
        "and plans the guard dropped for plain decoding after their drafts fell short.", "",
    ]
    bugs = sum(r["bugs"] for r in rows)
    ties = sum(r["ties"] for r in rows)
    if bugs:
        lines += [f"**ERROR: {bugs} run(s) differ from `ar` beyond a near-tie** (see "
                  "divergences from ar, below).", ""]
    elif ties:
        lines += [f"{ties} run(s) differ from `ar`, each at a proven near-tie (see "
                  "divergences from ar, below).", ""]
    for n in dict.fromkeys(r["context"] for r in rows):
        group = [r for r in rows if r["context"] == n]
        lines += [f"## context {n} (prompt {group[0]['prompt_tokens']:.0f} tokens)", "",
                  "| strategy | tok/s | speedup | decode tok/s | decode speedup | acceptance "
                  "| tokens/round | attn skipped | MLP skipped | selection % "
                  "| selections (fallbacks) | same tokens as ar |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
        for r in group:
            lines.append(
                f"| {r['strategy']} | {shown(r['tokens_per_s'], '.2f')} | "
                f"{shown(r['speedup'], '.3f')}x | {shown(r['decode_tokens_per_s'], '.2f')} | "
                f"{shown(r['decode_speedup'], '.3f')}x | "
                f"{shown(r['acceptance'], '.3f')} | {shown(r['tokens_per_round'], '.2f')} | "
                f"{r['attention_skipped']:.1f} | "
                f"{r['mlp_skipped']:.1f} | {r['selection_pct']:.1f} | "
                f"{r.get('selections', 0)} ({r.get('fallbacks', 0)}) | "
                f"{_same_tokens(r)} |")
        lines.append("")
        spread = [r for r in group if r["repeat_speedups"] and r["strategy"] != "ar"]
        if spread:
            lines += ["End-to-end speedup per repeat: " + "; ".join(
                f"{r['strategy']} " + ", ".join(f"{shown(x, '.3f')}x"
                                                for x in r["repeat_speedups"])
                for r in spread), ""]
    lines += plans_table(rows)
    lines += check_table(rows)
    lines += divergence_table(runs)
    path.write_text("\n".join(lines))


def plans_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per context and strategy that priced plans, its top plans."""
    planned = [r for r in rows if r.get("plans")]
    if not planned:
        return []
    lines = ["## plans", "",
             "Per plan (`a3,m5@4`: attention of layer 3 and MLP of layer 5 skipped, drafts of 4; "
             f"`ar`: plain decoding) the {PLANS_SHOWN} with the most seconds, the rest as "
             "other: tok/s are tokens over the rounds' draft and verify seconds (the selection "
             "not included); predicted: what the selection priced them at.", "",
             "| context | strategy | plan | rounds | tokens | tok/s | predicted tok/s |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r in planned:
        for p in r["plans"]:
            lines.append(f"| {r['context']} | {r['strategy']} | {p['plan']} | {p['rounds']} | "
                         f"{p['tokens']} | {shown(p['tokens_per_s'], '.2f')} | "
                         f"{shown(p['predicted_tokens_per_s'], '.2f')} |")
    return lines + [""]
