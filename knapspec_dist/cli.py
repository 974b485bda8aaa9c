"""The ``knapspec`` command line: generate, profile, bench, demo.

User errors (bad path, config, prompt, option) print one ``error: ...`` line and exit 2, with
no traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .errors import UserError

log = logging.getLogger("knapspec_dist")


def emit(text: str, *, error: bool = False) -> None:
    """A command's final report (stdout) or error line (stderr): the one place commands print;
    progress and diagnostics go through logging."""
    print(text, file=sys.stderr if error else sys.stdout)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="model folder, or 'smollm2' (embedded)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])


def _add_strategy_args(p: argparse.ArgumentParser) -> None:
    from .strategies import NAMES

    p.add_argument("--strategy", default="knapspec", choices=NAMES)
    p.add_argument("--skip", default="", help="static: skipped sublayers, e.g. a3,a5,m7 (0-based)")
    p.add_argument("--gamma", type=int, default=4, help="static / clasp draft length")
    p.add_argument("--tau-conf", type=float, default=0.7, help="draft confidence early exit")
    p.add_argument("--profile", default=None, help="latency profile JSON (knapspec, clasp)")
    p.add_argument("--interval", type=int, default=64, help="tokens between re-selections")
    p.add_argument("--coupled", action="store_true", help="skip attention+MLP of a layer together")
    p.add_argument("--objective", default="tpt", choices=["tpt", "alpha"])
    p.add_argument("--select-once", action="store_true", help="select after prefill only")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def strategy_options(args: argparse.Namespace):
    from .strategies import StrategyOptions

    return StrategyOptions(name=args.strategy, skip=args.skip, gamma=args.gamma,
                           tau_conf=args.tau_conf, profile=args.profile, interval=args.interval,
                           coupled=args.coupled, objective=args.objective,
                           select_once=args.select_once)


def generation_config(args: argparse.Namespace):
    from .sampling import SamplingConfig
    from .speculation.strategy import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingConfig(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed))


def cmd_generate(args: argparse.Namespace) -> int:
    from .local import encode, generate_texts, load

    if args.prompt_file:
        try:
            text = Path(args.prompt_file).read_text()
        except OSError as e:
            raise UserError(f"cannot read prompt file {args.prompt_file!r}: {e.strerror}") from None
    else:
        text = args.prompt
    options, config = strategy_options(args), generation_config(args)
    from .runtime.cli import generate_on_engine, uses_engine

    if uses_engine(args):
        result = generate_on_engine(args, text, options, config)
    else:
        loaded = load(args.model, args.dtype, args.device)
        prompt = encode(loaded.tokenizer, text, args.chat)
        result = generate_texts(loaded, [prompt], options, config)[0]
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                          "finish_reason": result.finish_reason,
                          "stats": result.stats.to_dict()}))
    else:
        s = result.stats
        print(result.text)
        print(f"\n[{options.name}] {s.new_tokens} tokens in {s.wall_s:.2f}s "
              f"({s.tokens_per_s:.1f} tok/s), prompt {s.prompt_tokens} tokens, "
              f"acceptance {s.acceptance_rate:.2f} ({s.accepted}/{s.drafted})", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The summarization batch job on the bundled sample chapters, with smollm2 on local Ray."""
    import os
    import time

    import pyarrow.parquet as pq

    from .corpus import bundled_sample_path
    from .jobs import JobConfig, report, run_job

    out = Path("outputs") / time.strftime("demo-%Y%m%d-%H%M%S")
    logging.getLogger("knapspec_dist.jobs").setLevel(logging.INFO)  # progress lines
    print(f"summarizing the 12 chapters (1-6k tokens each) of {bundled_sample_path()} with "
          f"smollm2 (knapspec, {args.max_new_tokens} new tokens each, plus one row with ar for "
          f"the speedup) on a local Ray: several minutes on a laptop CPU; results go to {out}/",
          file=sys.stderr)
    result = run_job(JobConfig(input=str(bundled_sample_path()), output=str(out.resolve()),
                               model="smollm2", strategy="knapspec",
                               max_new_tokens=args.max_new_tokens,
                               cpus_per_rank=max(1, min(4, os.cpu_count() or 1))))
    rows = pq.read_table(result.rows_path, columns=["id", "generated_text", "error"]).to_pylist()
    first = next((r for r in sorted(rows, key=lambda r: r["id"]) if r["error"] is None), None)
    if first is not None:
        print(f"--- {first['id']}:\n{first['generated_text'].strip()}\n---")
    print(report(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="knapspec", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from one prompt")
    _add_model_args(g)
    from .runtime.cli import add_engine_args, extend_profile

    add_engine_args(g)  # --tp / --replicas / --address: the Ray engine
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    _add_strategy_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="run the summarization batch job on the bundled chapters (smollm2, local Ray)")
    d.add_argument("--max-new-tokens", type=int, default=96)
    d.set_defaults(func=cmd_demo)

    for register in _extra_commands():
        register(sub)
    extend_profile(sub)  # profile --tp K

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _extra_commands():
    """Subcommands defined beside their modules (profile, bench, job, gpu-check)."""
    from . import jobs
    from .bench import command as bench
    from .gpucheck import command as gpu_check
    from .profiles import command as profile

    return [profile.register, bench.register, jobs.register, gpu_check.register]


if __name__ == "__main__":
    sys.exit(main())
