"""``knapspec bench``: run every strategy on every prompt, check against ``ar``, write results."""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
from dataclasses import replace
from pathlib import Path

from knapspec_dist.cli.common import emit
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.errors import UserError
from knapspec_dist.tools.bench.prompts import Prompt, build_prompts, resolve_tokenizer
from knapspec_dist.tools.bench.report import command_line, machine, plot, summarize, write_markdown
from knapspec_dist.tools.bench.specs import StrategySpec, build, parse_strategies
from knapspec_dist.engine.scheduler import generate

log = logging.getLogger(__name__)


def run(model, strategies: dict, prompts: dict[int, list[Prompt]], config,
        save=lambda runs: None, runner: ModelRunner | None = None) -> tuple[list[dict], list[str]]:
    """Every strategy on every prompt; returns the runs and the mismatch messages.

    Each run that differs from ``ar`` gets its first difference classified (one full-model
    forward, :func:`knapspec_dist.spec.ties.check_divergence`): ``divergence`` in the
    run's record, and a message saying near-tie or BUG.
    """
    from knapspec_dist.spec.ties import check_divergence

    labels = list(strategies)
    runs, mismatches = [], []
    for n, group in prompts.items():
        for j, prompt in enumerate(group):
            order = labels[j % len(labels):] + labels[:j % len(labels)]
            results = {}
            for label in order:
                r = generate(strategies[label], model, [prompt.ids], config, runner=runner)[0]
                results[label] = r
                s = r.stats
                log.info("context %d, %s, %s: %d tokens, %.2f tok/s (decode %.2f s), "
                         "acceptance %.2f", n, prompt.id, label, s.new_tokens, s.tokens_per_s,
                         s.wall_s - s.prefill_s, s.acceptance_rate)
            reference = results["ar"].token_ids
            for label in labels:
                r = results[label]
                div = check_divergence(model, prompt.ids, reference, r.token_ids)
                if div is not None:
                    mismatches.append(f"{label} differs from ar at context {n}, prompt "
                                      f"{prompt.id}, {div.describe()}")
                    (log.warning if div.is_tie else log.error)(mismatches[-1])
                runs.append({"strategy": label, "context": n, "prompt": prompt.id,
                             "prompt_tokens": len(prompt.ids), "matches_ar": div is None,
                             "first_mismatch": None if div is None else div.position,
                             "divergence": None if div is None else div.to_dict(),
                             "finish_reason": r.finish_reason,
                             "token_ids": r.token_ids, "stats": r.stats.to_dict()})
        save(runs)
    return runs, mismatches


def bugs(runs: list[dict]) -> list[dict]:
    """The runs whose difference from ``ar`` is not a proven near-tie."""
    return [r for r in runs if r.get("divergence") and r["divergence"]["verdict"] != "tie"]


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{what}: expected positive integers, got {text!r}")
    return values


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from knapspec_dist.model.embedded import resolve_model_path
    from knapspec_dist.model.weights import load_model, resolve_dtype
    from knapspec_dist.model.weights import resolve_device
    from knapspec_dist.engine.generation import GenerationConfig

    contexts = _ints(args.contexts, "--contexts")
    if args.new_tokens < 1 or args.prompts < 1:
        raise UserError("--new-tokens and --prompts must be >= 1")
    specs = parse_strategies(args.strategies)
    if args.profile is not None and not Path(args.profile).is_file():
        raise UserError(f"--profile {args.profile!r}: no such file")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    path = resolve_model_path(args.model)
    if not path.exists():
        raise UserError(f"model path {str(path)!r} does not exist")
    model = load_model(path, dtype=resolve_dtype(args.dtype), device=resolve_device(args.device))
    tokenizer = resolve_tokenizer(args.tokenizer, path, model.cfg.vocab_size)
    profile, profile_name = args.profile, args.profile
    if any(s.options.name in ("knapspec", "clasp") for s in specs):
        # One profile for every selecting strategy: found, loaded or measured once, not per spec.
        from knapspec_dist.profiles.store import resolve_profile

        profile = resolve_profile(args.profile, model)
        profile_name = args.profile or profile.key()
    specs = [StrategySpec(s.label, replace(s.options, profile=profile, interval=args.interval,
                                           tau_conf=args.tau_conf)) for s in specs]
    strategies = {s.label: build(s, model) for s in specs}
    runner = ModelRunner(model)  # one cache and set of graphs for every strategy
    prompts = build_prompts(tokenizer, contexts, args.prompts, model.cfg.max_position_embeddings,
                            args.new_tokens, args.prompt_style)
    config = GenerationConfig(max_new_tokens=args.new_tokens, stop_at_eos=args.stop_at_eos)

    header = {"command": command_line(args, parser), "machine": machine(args.device),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "torch": torch.__version__, "model": str(path), "dtype": args.dtype,
              "device": args.device, "new_tokens": args.new_tokens, "prompts": args.prompts,
              "contexts": contexts, "profile": profile_name,
              "strategies": {s.label: {**vars(s.options), "profile": profile_name}
                             for s in specs}}
    log.info("bench: %s", header["command"])

    if not args.no_warmup:
        warm = GenerationConfig(max_new_tokens=min(4, args.new_tokens), stop_at_eos=False)
        first = prompts[contexts[0]][0].ids
        for label, strategy in strategies.items():
            generate(strategy, model, [first[:64]], warm, runner=runner)
        log.info("warmed up")

    def save(runs: list[dict], mismatches: list[str] | None = None) -> None:
        doc = {**header, "mismatches": mismatches or [], "bugs": len(bugs(runs)), "runs": runs}
        if mismatches is not None:
            doc["summary"] = summarize(runs)
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(out / "results.json")

    runs, mismatches = run(model, strategies, prompts, config, save, runner)
    save(runs, mismatches)
    rows = summarize(runs)
    write_markdown(out / "results.md", header, rows, runs)
    plot(out, rows)
    emit(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'speedup.png'}, "
          f"{out / 'skipped.png'}")
    bad = bugs(runs)
    if mismatches and not bad:
        emit(f"{len(mismatches)} run(s) differ from ar, each at a proven near-tie "
             f"(see {out / 'results.md'})")
    if bad:
        from knapspec_dist.spec.ties import Divergence

        r = bad[0]
        emit(f"error: {len(bad)} run(s) differ from ar beyond a near-tie; first: "
             f"{r['strategy']} differs from ar at context {r['context']}, prompt {r['prompt']}, "
             f"{Divergence(**r['divergence']).describe()}", error=True)
        return 1
    return 0


def register(sub) -> None:
    from knapspec_dist.cli.common import add_model_args

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
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=2, help="documents per context")
    p.add_argument("--prompt-style", default="summarize", choices=["summarize", "continue"],
                   help="summarize: chat-wrapped summary request (if the tokenizer has a chat "
                        "template); continue: the bare document")
    p.add_argument("--profile", default=None, help="latency profile JSON (knapspec, clasp)")
    p.add_argument("--interval", type=int, default=64, help="tokens between re-selections")
    p.add_argument("--tau-conf", type=float, default=0.7, help="draft confidence early exit")
    p.add_argument("--stop-at-eos", action="store_true", help="stop a run at EOS")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=functools.partial(cmd_bench, parser=p))
