"""``knapspec peer``: one Parquet job through this engine and through vLLM, side by side.

    make vllm-venv        # vLLM's CPU build (vllm where CUDA is) in .venv-vllm, once
    knapspec peer --input knapspec_dist/data/sample_chapters.parquet --dtype fp32 \\
        --threads 2 --new-tokens 96 --max-num-seqs 16 --strategies ar,knapspec \\
        --vllm-ngram 2:3,4:3 --out bench/peer

The same model folder, prompt token ids, dtype, threads, rows at once, greedy decoding and new
tokens for both (tools/peer/compare.py says how each is timed); vLLM also with its own
n-gram drafts, each K:N of ``--vllm-ngram`` (a small sweep: ours is compared with the
fastest). Prints the ratios for
start-up, prefill, decode and end to end, and how many rows are token-identical to vLLM's;
writes ``peer.json`` and ``peer.md`` to ``--out``. Not part of ``make test``: it takes minutes.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
from pathlib import Path

from knapspec_dist.cli.common import add_number, emit, existing_model_path
from knapspec_dist.errors import UserError
from knapspec_dist.jobs.options import DEFAULT_INSTRUCTION
from knapspec_dist.tools.bench.report import command_line, machine
from knapspec_dist.tools.bench.specs import parse_strategies
from knapspec_dist.tools.corpus import bundled_sample_path
from knapspec_dist.tools.peer.compare import (
    compare,
    default_vllm_python,
    python_of_venv,
    read_job,
    run_ours,
    run_vllm,
    table,
)


def register(sub) -> None:
    p = sub.add_parser("peer", help="the same job through this engine and vLLM, side by side",
                       description=__doc__.split("\n\n")[0].strip("`"))
    p.add_argument("--input", default=None,
                   help="Parquet file of the job (default: the bundled chapters)")
    p.add_argument("--id-column", default="id")
    p.add_argument("--text-column", default="document")
    p.add_argument("--instruction", default=DEFAULT_INSTRUCTION)
    p.add_argument("--model", default="smollm2", help="model folder, or 'smollm2' (embedded)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    add_number(p, "--threads", default=2, help="CPU threads of each engine")
    add_number(p, "--new-tokens", default=96)
    add_number(p, "--max-num-seqs", default=16, help="rows at once, both engines")
    add_number(p, "--max-model-len", default=8192)
    p.add_argument("--strategies", default="ar", help="ours, as for bench: ar,knapspec")
    add_number(p, "--repeats", default=1,
               help="runs of each of our strategies, interleaved (the order rotates); each "
                    "is reported as their mean: on a noisy machine, more repeats")
    p.add_argument("--vllm-ngram", default="2:3,4:3",
                   help="vLLM's n-gram drafts, each K:N (K tokens drafted from n-grams of up "
                        "to N) run once beside plain vLLM; 'none' for plain vLLM alone")
    p.add_argument("--vllm-python", default=None,
                   help="vLLM's venv (or its python); default .venv-vllm (make vllm-venv)")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=functools.partial(cmd_peer, parser=p))


def parse_ngram(text: str) -> list[tuple[int, int]]:
    """``2:3,4:3`` -> [(2, 3), (4, 3)]; ``none`` -> []."""
    if text.strip().lower() in ("", "none"):
        return []
    out = []
    for part in text.split(","):
        k, _, n = part.strip().partition(":")
        if not (k.isdigit() and n.isdigit() and int(k) > 0 and int(n) > 0):
            raise UserError(f"--vllm-ngram {part.strip()!r}: expected K:N, two positive "
                            "integers, e.g. 4:3")
        out.append((int(k), int(n)))
    return out


def cmd_peer(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    specs = {s.label: s.options for s in parse_strategies(args.strategies)}
    if "ar" not in specs:
        specs = {"ar": parse_strategies("ar")[0].options, **specs}
    python = python_of_venv(args.vllm_python) if args.vllm_python else default_vllm_python()
    path = existing_model_path(args.model)
    job = read_job(args.input or str(bundled_sample_path()), str(path),
                   id_column=args.id_column, text_column=args.text_column,
                   instruction=args.instruction, dtype=args.dtype, threads=args.threads,
                   max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   new_tokens=args.new_tokens)
    sweep = parse_ngram(args.vllm_ngram)
    vllm = run_vllm(job, python)  # first: a missing venv fails before our runs
    ngram = {f"{k}:{n}": run_vllm(job, python, ngram=(k, n)) for k, n in sweep}
    ours = run_ours(job, specs, args.repeats)
    result = compare(job, ours, vllm, ngram)
    header = {"command": command_line(args, parser), "machine": machine("cpu"),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "torch": ours["torch"], "vllm": vllm["versions"], "model": str(path),
              "dtype": args.dtype, "threads": args.threads, "rows": len(job.prompts),
              "prompt_tokens": job.prompt_tokens}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peer.json").write_text(json.dumps({**header, **result, "ids": job.ids,
                                               "tokens": {"vllm": vllm["tokens"], **{
                                                   k: r["tokens"] for k, r in
                                                   ours["runs"].items()}}}, indent=1))
    lines = table(job, result)
    m = header["machine"]
    (out / "peer.md").write_text(
        f"# knapspec peer ({header['date']})\n\n`{header['command']}`\n\n"
        f"{m['cpu']}, {args.threads} threads each ({m['cpu_count']} CPUs), torch "
        f"{header['torch']}, vLLM {vllm['versions']['vllm']}; {len(job.prompts)} rows, "
        f"{job.prompt_tokens} prompt tokens, {args.dtype}, greedy, {args.new_tokens} new "
        f"tokens, {args.max_num_seqs} rows at once. Speed vs vLLM: vLLM's seconds over ours "
        "(above 1: we are faster).\n\n" + "\n".join(lines) + "\n")
    emit("\n".join(lines))
    return 0
