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
            "decode_tokens_per_s": (new - len(mine)) / decode if decode else 0.0,
            "acceptance": sum(s["accepted"] for s in mine) / drafted if drafted else None,
            # tokens per decode or verify round (the first token comes from the prefill)
            "tokens_per_round": ((new - len(mine)) / steps
                                 if (steps := sum(s.get("steps", 0) for s in mine)) else None),
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
        })
    for row in rows:
        ar = next(r for r in rows if r["context"] == row["context"] and r["strategy"] == "ar")
        row["speedup"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] else 0.0
        row["decode_speedup"] = (row["decode_tokens_per_s"] / ar["decode_tokens_per_s"]
                                 if ar["decode_tokens_per_s"] else 0.0)
        row["repeat_speedups"] = _repeat_speedups(runs, row["context"], row["strategy"])
    return rows


def _tokens_per_s(stats: list[dict]) -> float:
    """New tokens over wall seconds, prefill included, of runs summed."""
    wall = sum(s["wall_s"] for s in stats)
    return sum(s["new_tokens"] for s in stats) / wall if wall else 0.0


def _repeat_speedups(runs: list[dict], n: int, label: str) -> list[float]:
    """End-to-end speedup against ar per repeat (each over all prompts of the context): how
    far one repeat moves from another on this machine. Empty for a single repeat."""
    reps = sorted({r.get("repeat", 0) for r in runs if r["context"] == n})
    if len(reps) < 2:
        return []

    def rate(strategy: str, rep: int) -> float:
        return _tokens_per_s([r["stats"] for r in runs if r["context"] == n
                              and r["strategy"] == strategy and r.get("repeat", 0) == rep])
    return [(mine / ar if ar else 0.0) for mine, ar in
            ((rate(label, k), rate("ar", k)) for k in reps)]


def _all_match(matches) -> bool | None:
    values = list(matches)
    return None if None in values else all(values)


def _verdict(run: dict) -> str | None:
    """None: same tokens as ar, or not compared; else the divergence's verdict ("tie" or
    "BUG")."""
    if run["matches_ar"] is not False:
        return None
    div = run.get("divergence")
    return div["verdict"] if div else "BUG"


def _same_tokens(row: dict) -> str:
    if row["matches_ar"] is None:
        return "not compared"
    if row["bugs"]:
        return f"**NO: {row['bugs']} BUG**"
    if row["ties"]:
        return f"near-tie in {row['ties']}/{row['runs']}"
    return "yes"


def divergence_table(runs: list[dict]) -> list[str]:
    """Markdown lines: one row per run that differs from ar, with its near-tie classification."""
    bad = [r for r in runs if r["matches_ar"] is False]
    if not bad:
        return []
    lines = ["## divergences from ar", "",
             "At the first differing new token, one full-model forward of prompt + common "
             "prefix gives the logits of ar's token and the strategy's; gap = top logit - the "
             "lower of the two. A near-tie (gap <= tolerance: 4 steps of the model's dtype at the "
             "top logit, e.g. 0.5 in bf16 for logits in [16, 32); 0 in fp32) is kernel "
             "rounding; anything else is a BUG (knapspec_dist/tools/ties.py).", "",
             "| context | prompt | strategy | new token | ar token (logit) | its token (logit) "
             "| top logit | gap | tolerance | verdict |",
             "|---:|---|---|---:|---|---|---:|---:|---:|:---:|"]
    for r in bad:
        d = r.get("divergence") or {}

        def tok(t, z):
            return "end" if t is None else f"{t} ({_fmt(z, '.4g')})"

        verdict = d.get("verdict", "BUG")
        lines.append(
            f"| {r['context']} | {r['prompt']} | {r['strategy']} | "
            f"{_fmt(d.get('position', r.get('first_mismatch')), 'd')} | "
            f"{tok(d.get('reference_token'), d.get('reference_logit'))} | "
            f"{tok(d.get('candidate_token'), d.get('candidate_logit'))} | "
            f"{_fmt(d.get('top_logit'), '.4g')} | {_fmt(d.get('gap'), '.4g')} | "
            f"{_fmt(d.get('tolerance'), '.4g')} | "
            f"{'tie' if verdict == 'tie' else '**BUG**'} |")
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
    info = {"cpu": cpu_model_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def command_line(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The command that repeats this run, every option spelled out."""
    words = ["knapspec", "bench"]
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


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


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
                f"| {r['strategy']} | {r['tokens_per_s']:.2f} | {r['speedup']:.3f}x | "
                f"{r['decode_tokens_per_s']:.2f} | {r['decode_speedup']:.3f}x | "
                f"{_fmt(r['acceptance'], '.3f')} | {_fmt(r['tokens_per_round'], '.2f')} | "
                f"{r['attention_skipped']:.1f} | "
                f"{r['mlp_skipped']:.1f} | {r['selection_pct']:.1f} | "
                f"{r.get('selections', 0)} ({r.get('fallbacks', 0)}) | "
                f"{_same_tokens(r)} |")
        lines.append("")
        spread = [r for r in group if r["repeat_speedups"] and r["strategy"] != "ar"]
        if spread:
            lines += ["End-to-end speedup per repeat: " + "; ".join(
                f"{r['strategy']} " + ", ".join(f"{x:.3f}x" for x in r["repeat_speedups"])
                for r in spread), ""]
    lines += plans_table(rows)
    lines += divergence_table(runs)
    path.write_text("\n".join(lines))


def plans_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per context and strategy that priced plans, its top plans."""
    shown = [r for r in rows if r.get("plans")]
    if not shown:
        return []
    lines = ["## plans", "",
             "Per plan (`a3,m5@4`: attention of layer 3 and MLP of layer 5 skipped, drafts of 4; "
             f"`ar`: plain decoding) the {PLANS_SHOWN} with the most seconds, the rest as "
             "other: tok/s are tokens over the rounds' draft and verify seconds (the selection "
             "not included); predicted: what the selection priced them at.", "",
             "| context | strategy | plan | rounds | tokens | tok/s | predicted tok/s |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r in shown:
        for p in r["plans"]:
            lines.append(f"| {r['context']} | {r['strategy']} | {p['plan']} | {p['rounds']} | "
                         f"{p['tokens']} | {_fmt(p['tokens_per_s'], '.2f')} | "
                         f"{_fmt(p['predicted_tokens_per_s'], '.2f')} |")
    return lines + [""]
