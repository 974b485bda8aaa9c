"""``knapspec bench``: run every strategy on every prompt, check against ``ar``, write results.

The measurement is tools/bench/compare.py; this module checks the arguments, loads the model
and the one profile the selecting strategies share, and writes results.json / .md / plots.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from knapspec_dist.cli.common import (
    add_draw_args,
    add_model_args,
    add_number,
    emit,
    existing_model_path,
    generation_config,
    load_model_args,
    parse_ints,
)
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.engine.strategy import Strategy
from knapspec_dist.errors import UserError
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.profiles.store import resolve_profile
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.tools.bench import findings
from knapspec_dist.tools.bench.compare import bugs, compare_strategies
from knapspec_dist.tools.bench.plots import plot_bench, plot_findings
from knapspec_dist.tools.bench.prompts import Prompt, build_prompts, resolve_tokenizer
from knapspec_dist.tools.bench.report import (
    command_line,
    machine,
    sampling_line,
    summarize,
    write_markdown,
)
from knapspec_dist.tools.bench.specs import NamedStrategy, parse_strategies
from knapspec_dist.tools.ties import Divergence

log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("bench", help="compare strategies on long-document prompts",
                       description=__doc__.split("\n\n")[0].strip("`"))
    add_model_args(p)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or 'smollm2' (default: the model's own; 'bytes' or a "
                        "model without one: UTF-8 bytes as token ids)")
    p.add_argument("--contexts", default="1024,2048,4096,8192",
                   help="prompt lengths in tokens, comma-separated")
    p.add_argument("--strategies", default="ar,clasp,knapspec",
                   help="specs like ar,clasp,knapspec,knapspec:coupled,knapspec:alpha,"
                        "knapspec:once,static:a3,m5@4")
    add_number(p, "--new-tokens", default=128)
    add_number(p, "--prompts", default=2, help="documents per context")
    add_number(p, "--repeats", default=1,
               help="runs of every strategy on every document, interleaved (the order "
                    "rotates); the rates sum them all: on a noisy machine, more repeats")
    p.add_argument("--prompt-style", default="summarize", choices=["summarize", "continue"],
                   help="summarize: chat-wrapped summary request (if the tokenizer has a chat "
                        "template); continue: the bare document")
    p.add_argument("--profile", default=None, help="latency profile JSON (knapspec, clasp)")
    add_number(p, "--interval", default=64, help="tokens between re-selections")
    add_number(p, "--tau-conf", default=0.7, help="draft confidence early exit")
    p.add_argument("--stop-at-eos", action="store_true", help="stop a run at EOS")
    add_draw_args(p, seed=0)  # sampled runs are seeded: ar and the strategies draw alike
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--preset", default=None, choices=["findings"],
                   help="findings: the paper's four findings, knapspec:paper against its "
                        "ablations (tools/bench/findings.py), with its own strategies, "
                        "contexts, documents, tokens and interval where those are not given; "
                        "also writes findings.md and findings.png")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=functools.partial(cmd_bench, parser=p))


@dataclass
class Setup:
    """What a bench run works on, ready to measure."""

    path: Path
    model: Transformer
    specs: list[NamedStrategy]
    strategies: dict[str, Strategy]
    profile_name: str | None
    prompts: dict[int, list[Prompt]]


def apply_preset(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The preset's values for the options left at their defaults."""
    if args.preset == "findings":
        for key, value in findings.PRESET.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    apply_preset(args, parser)
    contexts = parse_ints(args.contexts, "--contexts")
    specs = parse_strategies(args.strategies)
    if args.profile is not None and not Path(args.profile).is_file():
        raise UserError(f"--profile {args.profile!r}: no such file")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = prepare(args, contexts, specs)
    runner = ModelRunner(setup.model)  # one cache and set of graphs for every strategy
    config = generation_config(args, args.new_tokens, args.stop_at_eos)
    header = results_header(args, parser, setup, contexts, config)
    log.info("bench: %s", header["command"])
    if not args.no_warmup:
        warm_up(setup, runner, config, min(4, args.new_tokens), contexts[0])

    def save(runs: list[dict], mismatches: list[str] | None = None) -> None:
        write_results(out, header, runs, mismatches)

    runs, mismatches = compare_strategies(setup.model, setup.strategies, setup.prompts, config,
                                          save, runner, args.repeats)
    save(runs, mismatches)
    if args.preset == "findings":
        write_findings(out, header, runs, mismatches, setup.model.cfg.num_layers)
    return report(out, header, runs, mismatches)


def write_findings(out: Path, header: dict, runs: list[dict], mismatches: list[str],
                   num_layers: int) -> None:
    """findings.md and findings.png: the paper's four findings from these runs."""
    rows = summarize(runs)
    result = {"rows": rows, "mismatches": mismatches,
              "findings": findings.findings(rows, num_layers)}
    lines = ["# The paper's findings, measured", "", f"- command: `{header['command']}`",
             f"- date: {header['date']}; {header['new_tokens']} new tokens, "
             f"{header['prompts']} document(s) per context, {sampling_line(header['sampling'])}",
             "",
             (findings.__doc__ or "").split("\n\n")[1].strip(), "",
             *findings.findings_markdown(result)]
    (out / "findings.md").write_text("\n".join(lines))
    plot_findings(out / "findings.png", result["findings"])
    emit(f"wrote {out / 'findings.md'}, {out / 'findings.png'}")


def prepare(args: argparse.Namespace, contexts: list[int], specs: list[NamedStrategy]) -> Setup:
    """The model, its tokenizer's prompts, and the strategies of the specs with the one profile
    every selecting strategy shares (found, loaded or measured once, not per spec)."""
    path = existing_model_path(args.model)
    model = load_model_args(path, args)
    tokenizer = resolve_tokenizer(args.tokenizer, path, model.cfg.vocab_size)
    profiles, profile_name = None, args.profile
    if any(s.options.name in ("knapspec", "clasp") for s in specs):
        profiles = [resolve_profile(args.profile, model)]
        profile_name = args.profile or profiles[0].key()
    specs = [NamedStrategy(s.label, replace(s.options, profile=args.profile, interval=args.interval,
                                           tau_conf=args.tau_conf)) for s in specs]
    strategies = {s.label: build_strategy(s.options, model, profiles) for s in specs}
    prompts = build_prompts(tokenizer, contexts, args.prompts, model.cfg.max_position_embeddings,
                            args.new_tokens, args.prompt_style)
    return Setup(path, model, specs, strategies, profile_name, prompts)


def results_header(args: argparse.Namespace, parser: argparse.ArgumentParser, setup: Setup,
                   contexts: list[int], config: GenerationConfig) -> dict:
    """What results.json says about the run besides its runs (``sampling``: how tokens were
    drawn and sampled drafts verified)."""
    return {"command": command_line(args, parser), "machine": machine(args.device),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "torch": torch.__version__, "model": str(setup.path), "dtype": args.dtype,
            "device": args.device, "new_tokens": args.new_tokens, "prompts": args.prompts,
            "repeats": args.repeats, "sampling": asdict(config.sampling),
            "contexts": contexts, "profile": setup.profile_name,
            "strategies": {s.label: {**vars(s.options), "profile": setup.profile_name}
                           for s in setup.specs}}


def warm_up(setup: Setup, runner: ModelRunner, config: GenerationConfig, new_tokens: int,
            context: int) -> None:
    """A few tokens of every strategy on the first prompt's start (graphs, caches, first
    selection), so the measured runs pay none of it."""
    warm = replace(config, max_new_tokens=new_tokens, stop_at_eos=False)
    first = setup.prompts[context][0].ids
    for strategy in setup.strategies.values():
        generate(strategy, setup.model, [first[:64]], warm, runner=runner)
    log.info("warmed up")


def write_results(out: Path, header: dict, runs: list[dict],
                  mismatches: list[str] | None = None) -> None:
    """results.json, atomically; the summary once the mismatches are known (the last save)."""
    doc = {**header, "mismatches": mismatches or [], "bugs": len(bugs(runs)), "runs": runs}
    if mismatches is not None:
        doc["summary"] = summarize(runs)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out / "results.json")


def report(out: Path, header: dict, runs: list[dict], mismatches: list[str]) -> int:
    """results.md and the plots; the final lines; exit status 1 when a run differs from ar
    beyond a near-tie."""
    rows = summarize(runs)
    write_markdown(out / "results.md", header, rows, runs)
    plot_bench(out, rows)
    emit(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'speedup.png'}, "
         f"{out / 'skipped.png'}")
    bad = bugs(runs)
    if mismatches and not bad:
        emit(f"{len(mismatches)} run(s) differ from ar, each at a proven near-tie "
             f"(see {out / 'results.md'})")
    if bad:
        r = bad[0]
        emit(f"error: {len(bad)} run(s) differ from ar beyond a near-tie; first: "
             f"{r['strategy']} differs from ar at context {r['context']}, prompt {r['prompt']}, "
             f"{Divergence(**r['divergence']).describe()}", error=True)
        return 1
    return 0
