"""The paper's four findings, measured on our engine: ``knapspec:paper`` against its ablations.

- (a) more attention is skipped at long context: attention and MLP shares skipped per drafted
  token by ``knapspec:paper``, per context;
- (b) decoupled beats coupled: ``knapspec:paper`` over ``knapspec:paper+coupled``;
- (c) TPT beats the alpha objective: over ``knapspec:paper+alpha``;
- (d) dynamic re-selection beats select-once as the context grows: over
  ``knapspec:paper+once``.

Ratios are of decode rates (tokens after the first over the seconds after prefill): every
strategy pays the same prefill, which would only dilute them. ``knapspec`` (our default) and
``ar`` are in the same runs; every run is checked token for token against ``ar``. The same
functions make ``knapspec bench --preset findings`` and the gpu-check's section
(``run_findings``, ``findings_markdown``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.profiles.profile import LatencyProfile
from knapspec_dist.ratio import ratio, shown
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.tools.bench.compare import compare_strategies
from knapspec_dist.tools.bench.prompts import Prompt
from knapspec_dist.tools.bench.report import summarize
from knapspec_dist.tools.bench.specs import parse_strategies

PAPER = "knapspec:paper"
ABLATIONS = {"b": f"{PAPER}+coupled", "c": f"{PAPER}+alpha", "d": f"{PAPER}+once"}
STRATEGIES = ",".join(["ar", "knapspec", PAPER, *ABLATIONS.values()])
# ``knapspec bench --preset findings``: sized to finish in about 10-15 minutes on 2 shared CPU
# cores; the interval (rounds) is the authors' 64 scaled to 96 tokens, so that
# re-selection (d) happens at all.
PRESET = {"strategies": STRATEGIES, "contexts": "1024,2048,4096,8192", "prompts": 1,
          "new_tokens": 96, "interval": 16}


def findings(rows: list[dict], num_layers: int) -> list[dict]:
    """Per context, from ``report.summarize``'s rows: the four findings' numbers."""
    out = []
    for n in dict.fromkeys(r["context"] for r in rows):
        at = {r["strategy"]: r for r in rows if r["context"] == n}
        if PAPER not in at:
            continue
        paper = at[PAPER]

        def over(label: str) -> float | None:
            other = at.get(label)
            return None if other is None else ratio(paper["decode_tokens_per_s"],
                                                    other["decode_tokens_per_s"])

        out.append({
            "context": n,
            "attention_share": paper["attention_skipped"] / num_layers,
            "mlp_share": paper["mlp_skipped"] / num_layers,
            **{f"paper_over_{k}": over(label) for k, label in ABLATIONS.items()},
            "paper_vs_ar": paper["decode_speedup"],
            "default_vs_ar": at["knapspec"]["decode_speedup"] if "knapspec" in at else None,
            "paper_over_default": over("knapspec"),
            "all_match_ar": all(r["matches_ar"] for r in at.values()),
        })
    return out


def run_findings(model: Transformer, prompts: dict[int, list[Prompt]],
                 config: GenerationConfig, profiles: list[LatencyProfile] | None = None, *,
                 interval: int = PRESET["interval"], runner: ModelRunner | None = None,
                 save: Callable[[list[dict]], None] = lambda runs: None) -> dict:
    """Every strategy of the findings on ``prompts`` (context -> documents): the runs, the
    mismatches with ``ar``, the per-(context, strategy) rows and the findings per context.
    ``profiles``: what prices the selecting strategies (None: resolved as decoding does)."""
    specs = parse_strategies(STRATEGIES)
    strategies = {s.label: build_strategy(replace(s.options, interval=interval), model,
                                          profiles) for s in specs}
    runs, mismatches = compare_strategies(model, strategies, prompts, config, save, runner)
    rows = summarize(runs)
    return {"runs": runs, "mismatches": mismatches, "rows": rows,
            "findings": findings(rows, model.cfg.num_layers)}


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}x"


def findings_markdown(result: dict) -> list[str]:
    """Markdown lines: the findings table, then every strategy's acceptance, tokens per round
    and speedups, per context."""
    lines = ["| context | (a) attention skipped | (a) MLP skipped | (b) paper / coupled "
             "| (c) paper / alpha | (d) paper / once | paper vs ar | default vs ar "
             "| paper / default | all token-identical to ar |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for f in result["findings"]:
        lines.append(
            f"| {f['context']} | {f['attention_share']:.0%} | {f['mlp_share']:.0%} | "
            f"{_x(f['paper_over_b'])} | {_x(f['paper_over_c'])} | {_x(f['paper_over_d'])} | "
            f"{_x(f['paper_vs_ar'])} | {_x(f['default_vs_ar'])} | "
            f"{_x(f['paper_over_default'])} | {'yes' if f['all_match_ar'] else '**NO**'} |")
    lines += ["", "| context | strategy | acceptance | tokens per round | decode tok/s "
              "| decode speedup vs ar | end-to-end speedup vs ar | selections "
              "| same tokens as ar |",
              "|---:|---|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['context']} | {r['strategy']} | {shown(r['acceptance'], '.3f')} | "
            f"{shown(r['tokens_per_round'], '.2f')} | {shown(r['decode_tokens_per_s'], '.2f')} | "
            f"{shown(r['decode_speedup'], '.3f')}x | {shown(r['speedup'], '.3f')}x | "
            f"{r['selections']} | "
            f"{'yes' if r['matches_ar'] else '**NO**'} |")
    return lines + [""]
