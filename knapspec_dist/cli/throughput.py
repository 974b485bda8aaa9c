"""``knapspec throughput``: a job-like workload through one replica's continuous batching.

    knapspec throughput --model smollm2 --contexts 1024 --documents 8 --new-tokens 128 \\
        --strategies ar,knapspec --batch 1,8 --out bench/throughput

The measurement and what it reports: tools/bench/throughput.py. Outputs in ``--out``:
``throughput.json``, ``throughput.md`` and ``throughput.png``; exit status 1 when a row
differs from ``ar`` beyond a near-tie.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
from dataclasses import asdict, replace
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
from knapspec_dist.engine.scheduler import max_num_batched_tokens
from knapspec_dist.errors import UserError
from knapspec_dist.speculation.factory import StrategyBuilder
from knapspec_dist.tools.bench.paged import compare, documents, window_rows
from knapspec_dist.tools.bench.paged import table as paged_table
from knapspec_dist.tools.bench.plots import plot_throughput
from knapspec_dist.tools.bench.prompts import resolve_tokenizer
from knapspec_dist.tools.bench.report import command_line, machine, sampling_line
from knapspec_dist.tools.bench.specs import parse_strategies
from knapspec_dist.tools.bench.throughput import measure, table, workload


def register(sub) -> None:
    p = sub.add_parser("throughput", help="continuous-batching throughput on a job-like workload",
                       description=__doc__.split("\n\n")[0].strip("`"))
    add_model_args(p)
    p.add_argument("--tokenizer", default=None, help="as for bench")
    p.add_argument("--contexts", default="1024",
                   help="longest prompt per workload, comma-separated")
    add_number(p, "--documents", default=8, help="documents per context")
    p.add_argument("--batch", default="1,8", help="max_num_seqs values, comma-separated")
    p.add_argument("--strategies", default="ar,knapspec", help="as for bench")
    add_number(p, "--new-tokens", default=128)
    add_number(p, "--max-num-batched-tokens", default=None,
               help="prompt tokens a step prefills (default 8192)")
    add_number(p, "--repeats", default=1,
               help="runs of each configuration, interleaved; the median is reported")
    add_draw_args(p, seed=0)  # sampled runs are seeded: ar and the strategies draw alike
    p.add_argument("--out", required=True, help="output folder")
    add_number(p, "--kv-cache-memory", metavar="SIZE",
               help="compare paged KV with fixed slots under this K/V budget (2GiB, 500MB); "
                    "the documents then come from --lengths")
    p.add_argument("--lengths", default="200-3000", help="with --kv-cache-memory: LO-HI tokens")
    add_number(p, "--page-size", default=None,
               help="with --kv-cache-memory: positions per page (default: the backend's, "
                    "16 under sdpa, 128 under flex)")
    p.set_defaults(func=functools.partial(cmd_throughput, parser=p))


def cmd_throughput(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    contexts, batches = parse_ints(args.contexts, "--contexts"), parse_ints(args.batch, "--batch")
    specs = {s.label: s for s in parse_strategies(args.strategies)}
    config = replace(generation_config(args, args.new_tokens, stop_at_eos=False),
                     max_num_batched_tokens=args.max_num_batched_tokens)
    path = existing_model_path(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model_args(path, args)
    tokenizer = resolve_tokenizer(args.tokenizer, path, model.cfg.vocab_size)
    if args.kv_cache_memory is not None:
        return cmd_paged(args, parser, model, tokenizer, specs, config)
    work = workload(tokenizer, contexts, args.documents, model.cfg.max_position_embeddings,
                    args.new_tokens)
    # sampled runs are priced against greedy decoding in the same run
    draws = ({"greedy": config} if config.sampling.greedy else
             {"greedy": replace(config, sampling=replace(config.sampling, temperature=0.0)),
              "sampled": config})
    build = StrategyBuilder(model)  # one profile for every run, measured at most once
    runs = measure(model, lambda label: build(specs[label].options), list(specs), work, batches,
                   draws, args.repeats)
    header = {"command": command_line(args, parser), "machine": machine(args.device),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "torch": torch.__version__, "model": str(path), "dtype": args.dtype,
              "device": args.device, "new_tokens": args.new_tokens,
              "max_num_batched_tokens": max_num_batched_tokens(config, model.device),
              "sampling": asdict(config.sampling),
              "documents": {n: [rid for rid, _ in rows] for n, rows in work.items()}}
    return write_results(out, header, runs)


def cmd_paged(args, parser, model, tokenizer, specs, config) -> int:
    """Paged KV against fixed slots under ``--kv-cache-memory`` (tools/bench/paged.py)."""
    lo, _, hi = args.lengths.partition("-")
    lo, hi = parse_ints(f"{lo},{hi}", "--lengths")
    if lo > hi:
        raise UserError(f"--lengths {args.lengths}: expected LO-HI")
    budget = args.kv_cache_memory
    window_rows(model, budget)  # a budget too small for one row, before any document is made
    rows = documents(tokenizer, lo, hi, args.documents, model.cfg.max_position_embeddings,
                     args.new_tokens)
    build = StrategyBuilder(model)
    entries = compare(model, lambda label: build(specs[label].options), list(specs), rows,
                      config, budget, args.page_size, args.repeats)
    out = Path(args.out)
    header = {"command": command_line(args, parser), "machine": machine(args.device),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "torch": torch.__version__, "model": str(args.model), "dtype": args.dtype,
              "new_tokens": args.new_tokens, "documents": [rid for rid, _ in rows],
              "max_num_batched_tokens": max_num_batched_tokens(config, model.device)}
    (out / "paged.json").write_text(json.dumps({**header, "runs": entries}, indent=1))
    lines = paged_table(entries)
    (out / "paged.md").write_text(f"# knapspec throughput, paged against fixed "
                                  f"({header['date']})\n\n`{header['command']}`\n\n"
                                  f"{header['machine']}, torch {header['torch']}\n\n"
                                  + "\n".join(lines) + "\n")
    emit("\n".join(lines))
    if any(e["identical_rows"] != e["rows"] for e in entries):
        emit("error: paged rows differ from fixed slots", error=True)
        return 1
    return 0


def write_results(out: Path, header: dict, runs: list[dict]) -> int:
    """throughput.json / .md / .png and the table; exit status 1 when a row differs from ar
    beyond a near-tie."""
    (out / "throughput.json").write_text(json.dumps({**header, "runs": runs}, indent=1))
    lines = table(runs)
    (out / "throughput.md").write_text(
        f"# knapspec throughput ({header['date']})\n\n`{header['command']}`\n\n"
        f"{header['machine']}, torch {header['torch']}, {sampling_line(header['sampling'])}"
        "\n\n" + "\n".join(lines) + "\n")
    plot_throughput(out / "throughput.png", runs)
    emit("\n".join(lines))
    bugs = [d for r in runs for d in r["divergences"] if d["verdict"] != "tie"]
    if bugs:
        emit(f"error: {len(bugs)} row(s) differ from ar beyond a near-tie", error=True)
        return 1
    return 0
