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

from knapspec_dist.cli.common import (add_engine_args, add_model_args, add_sampling_args,
                          add_strategy_args, emit, generation_config, strategy_options,
                          uses_engine)
from knapspec_dist.errors import UserError
from knapspec_dist.llm import generate_texts, load
from knapspec_dist.model.tokenizer import encode

log = logging.getLogger("knapspec_dist")


def cmd_generate(args: argparse.Namespace) -> int:
    """Every ``--prompt`` / ``--prompt-file`` (repeatable), continuously batched
    (``--max-num-seqs`` rows at once), in process or on the Ray engine."""
    texts = list(args.prompt or [])
    for path in args.prompt_file or []:
        try:
            texts.append(Path(path).read_text())
        except OSError as e:
            raise UserError(f"cannot read prompt file {path!r}: {e.strerror}") from None
    if not texts:
        raise UserError("give --prompt or --prompt-file (each may repeat)")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise UserError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    options, config = strategy_options(args), generation_config(args)
    from knapspec_dist.cli.engine_commands import generate_on_engine

    if uses_engine(args):
        results = generate_on_engine(args, texts, options, config)
    else:
        loaded = load(args.model, args.dtype, args.device)
        prompts = [encode(loaded.tokenizer, text, args.chat) for text in texts]
        results = generate_texts(loaded, prompts, options, config, args.max_num_seqs)
    for result in results:
        s = result.stats
        if args.json:
            print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                              "finish_reason": result.finish_reason, "stats": s.to_dict()}))
        else:
            print(result.text)
            print(f"\n[{options.name}] {s.new_tokens} tokens in {s.wall_s:.2f}s "
                  f"({s.tokens_per_s:.1f} tok/s), prompt {s.prompt_tokens} tokens, "
                  f"acceptance {s.acceptance_rate:.2f} ({s.accepted}/{s.drafted})",
                  file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The summarization batch job on the bundled sample chapters, with smollm2 on local Ray."""
    import os
    import time

    import pyarrow.parquet as pq

    from knapspec_dist.tools.corpus import bundled_sample_path
    from knapspec_dist.jobs import JobConfig, report, run_job

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

    g = sub.add_parser("generate", help="generate from one or more prompts (batched)")
    add_model_args(g)
    from knapspec_dist.cli.engine_commands import extend_profile

    add_engine_args(g)  # --tp / --replicas / --address: the Ray engine
    g.add_argument("--prompt", action="append", help="a prompt (repeat for more)")
    g.add_argument("--prompt-file", action="append", help="a file holding one prompt (repeatable)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="prompts decoded at once (default: all of them in process; the memory "
                        "rule on the engine)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_strategy_args(g)
    add_sampling_args(g)
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
        emit(f"error: {e}", error=True)
        return 2


def _extra_commands():
    """Subcommands defined beside their modules (profile, bench, throughput, job, gpu-check)."""
    from knapspec_dist import jobs
    from knapspec_dist.cli import bench
    from knapspec_dist.tools.bench import throughput
    from knapspec_dist.cli import gpu_check
    from knapspec_dist.cli import profile

    return [profile.register, bench.register, throughput.register, jobs.register,
            gpu_check.register]


if __name__ == "__main__":
    sys.exit(main())
