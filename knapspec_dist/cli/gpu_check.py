"""``knapspec gpu-check``: the command line, the plan of a full or ``--quick`` run, and the
order of its sections (shapes, correctness, long documents), writing results after each."""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
from pathlib import Path

import torch

from knapspec_dist.cli.common import emit, run
from knapspec_dist.errors import UserError
from knapspec_dist.profiles.device import device_info
from knapspec_dist.tools.gpucheck import batched, correct, measure, report, shapes
from knapspec_dist.tools.gpucheck.budget import Budget

log = logging.getLogger(__name__)

FULL = dict(contexts=(1024, 16384, 65536), batches=(1, 8, 32), qs=(2, 4, 8, 11),
            ab_contexts=(1024, 16384, 65536), iters=20, budget_s=330.0,
            correct=dict(new_tokens=48, prompt_tokens=256, count=2, profile_contexts=(256, 1024)),
            bench=dict(contexts=(1024, 4096, 8192), count=3, new_tokens=64),
            batched=dict(context=8192, batches=(8, 32), new_tokens=64,
                         profile_contexts=(1024, 8192)))
QUICK = dict(contexts=(64, 256), batches=(1, 2), qs=(2, 4), ab_contexts=(64, 256), iters=3,
             budget_s=45.0,
             correct=dict(new_tokens=12, prompt_tokens=24, count=1, profile_contexts=(32, 64)),
             bench=dict(contexts=(64, 128), count=1, new_tokens=8),
             batched=dict(context=64, batches=(2, 4), new_tokens=8, profile_contexts=(32, 64)))


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this check (defaults left out)."""
    parts = ["knapspec gpu-check", f"--device {args.device}"] + (["--quick"] if args.quick else [])
    for flag, value in (("--budget", args.budget), ("--bandwidth", args.bandwidth),
                        ("--memory-gib", args.memory_gib)):
        if value is not None and not (flag == "--bandwidth" and value == 4.3):
            parts.append(f"{flag} {value:g}")
    return " ".join(parts + [f"--out {args.out}"])


def cmd_gpu_check(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here (use --device cpu --quick on a CPU)")
    device = torch.device(args.device)
    setup = QUICK if args.quick else FULL
    budget = Budget(args.budget if args.budget else setup["budget_s"])
    doc = new_document(args, setup, device_info(device), budget)
    out = Path(args.out)

    def save() -> str:
        doc["meta"]["wall_s"] = budget.elapsed()
        return report.write(out, doc)[2]

    log.info("gpu-check on %s, budget %.0f s", doc["meta"]["device_name"], budget.total_s)
    run_sections(doc, args, setup, device, budget, save)
    emit(save())
    bugs = [r for r in doc["correctness"]["greedy"] + doc["bench"]["runs"]
            + doc["batched"]["runs"] if r.get("verdict") == "BUG"]
    if bugs:
        emit(f"error: {len(bugs)} greedy run(s) diverge from ar beyond a near-tie", error=True)
        return 1
    return 0


def new_document(args: argparse.Namespace, setup: dict, info: dict, budget: Budget) -> dict:
    """gpu-check.json before any section ran: what was asked, on what, and empty sections."""
    return {"meta": {"command": command_line(args),
                     "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                     "device": info, "device_name": info.get("name"), "torch": torch.__version__,
                     "quick": args.quick, "budget_s": budget.total_s, "dtype": "bf16",
                     "bandwidth_tb_s": args.bandwidth, "plan": setup, "wall_s": 0.0},
            "decode": [], "verify": [], "draft": [], "backends": [], "captures": [],
            "correctness": {"greedy": [], "sampling": [], "notes": []},
            "bench": {"runs": [], "summary": [], "notes": []},
            "batched": {"runs": [], "notes": []}, "notes": []}


def run_sections(doc: dict, args: argparse.Namespace, setup: dict, device: torch.device,
                 budget: Budget, save) -> None:
    """Shapes, correctness, long documents and batching, in that order, each in its share of
    the budget; the results are saved after each (a killed check keeps what it measured)."""
    limit = int(args.memory_gib * shapes.GIB) if args.memory_gib else None
    plan = measure.Plan(setup["contexts"], setup["batches"], setup["qs"], setup["ab_contexts"],
                        setup["iters"], args.bandwidth * 1e12, limit)
    with torch.inference_mode():
        found = measure.run_shapes(shapes.shapes(args.quick), device, torch.bfloat16, plan,
                                   budget.section("shapes"))
        doc["notes"] += found.pop("notes")
        doc.update(found)
        save()
        doc["correctness"] = correct.run_correctness(device, args.quick,
                                                     budget.section("correctness"),
                                                     **setup["correct"])
        save()
        doc["bench"] = correct.run_bench(device, args.quick, budget.section("bench"),
                                         **setup["bench"])
        save()
        doc["batched"] = batched.run_batched(device, args.quick, budget.section("batched"),
                                             **setup["batched"])


def register(sub) -> None:
    add_args(sub.add_parser("gpu-check", help="measure the GPU path (decode vs memory bound, "
                            "verify, draft, backends, correctness) into DIR/gpu-check.json and .md",
                            description=(__doc__ or "").split("\n\n")[0]))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU CI), under a minute")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole check (default 330; --quick 45)")
    p.add_argument("--bandwidth", type=float, default=4.3,
                   help="memory bandwidth of the bound, TB/s (H200 copy: 4.3)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="treat the device as having at most this much free memory")
    p.set_defaults(func=cmd_gpu_check)


def main(argv: list[str] | None = None) -> int:
    """``python -m knapspec_dist.cli.gpu_check``: gpu-check without the other commands, whose
    imports need Ray (the GPU image has none; the CI lane with its versions runs it so)."""
    p = argparse.ArgumentParser(prog="python -m knapspec_dist.cli.gpu_check",
                                description=(__doc__ or "").split("\n\n")[0])
    add_args(p)
    return run(p, argv)


if __name__ == "__main__":
    sys.exit(main())
