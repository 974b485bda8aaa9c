"""``knapspec gpu-check``: the command line, the plan of a full or ``--quick`` run, and the
order of its sections (rows.py runs them: results written after every row, one failure costs
one row, a poisoned device stops only the sections after it). Its first line says whether the
real model (SmolLM2) is there; without it the real-model sections do not run."""

from __future__ import annotations

import argparse
import datetime
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from knapspec_dist.cli.common import emit
from knapspec_dist.errors import UserError
from knapspec_dist.model.attention import default_backend
from knapspec_dist.profiles.device import device_info
from knapspec_dist.tools.gpucheck import (
    batched,
    bf16,
    correct,
    findings,
    late,
    measure,
    paged,
    report,
    shapes,
)
from knapspec_dist.tools.gpucheck.budget import Budget, Section, process_start
from knapspec_dist.tools.gpucheck.rows import Rows, run_sections

log = logging.getLogger(__name__)

# The whole process on one H200 (imports, SmolLM2's conversion, compiles, captures, every
# section and the report): a device call of at most 360 s, of which unpacking the wheels and
# the machine notes before it (scripts/gpu_run.sh) take about 20 s and the last row in
# flight when a share runs out up to half a minute.
BUDGET_S = 300.0
FULL = dict(contexts=(1024, 16384, 65536), batches=(1, 8, 32), qs=(2, 4, 8, 11),
            ab_contexts=(1024, 16384, 65536), iters=20, budget_s=BUDGET_S,
            correct=dict(new_tokens=48, prompt_tokens=256, count=2, profile_contexts=(256, 1024)),
            bf16=dict(prompt_tokens=256, new_tokens=48, count=2, skips=("attn25", "mixed"),
                      spread_tokens=32, batches=(1, 4, 8, 16)),
            bench=dict(contexts=(1024, 4096, 8192), count=3, new_tokens=64),
            batched=dict(context=8192, batches=(8, 32), new_tokens=64,
                         profile_contexts=(1024, 8192)),
            findings=dict(contexts=(1024, 2048, 4096, 8192), new_tokens=96, interval=16,
                          profile_contexts=(1024, 8192)),
            paged=dict(context=1024, batches=(1, 16, 64, 256), tokens=(1, 5, 17)))
QUICK = dict(contexts=(64, 256), batches=(1, 2), qs=(2, 4), ab_contexts=(64, 256), iters=3,
             budget_s=60.0,
             correct=dict(new_tokens=12, prompt_tokens=24, count=1, profile_contexts=(32, 64)),
             bf16=dict(prompt_tokens=24, new_tokens=12, count=2, skips=("mixed",),
                       spread_tokens=6, batches=(1, 4)),
             bench=dict(contexts=(64, 128), count=1, new_tokens=8),
             batched=dict(context=64, batches=(2, 4), new_tokens=8, profile_contexts=(32, 64)),
             findings=dict(contexts=(64,), new_tokens=12, interval=7, profile_contexts=(32, 64)),
             paged=dict(context=64, batches=(1, 4), tokens=(1, 5)))


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
    setup = QUICK if args.quick else FULL
    budget = Budget(args.budget if args.budget else setup["budget_s"], started=process_start())
    real = correct.real_model(args.quick)
    emit(real.headline())  # the first line: are the real-model rows real?
    device = torch.device(args.device)
    doc = new_document(args, setup, device_info(device), budget, real)
    doc["meta"]["setup_s"] = budget.elapsed()  # imports and the conversion, before any section
    doc["kernels"] = kernels(args.quick, real, device)
    out = Path(args.out)

    def save() -> Path:
        doc["meta"]["wall_s"] = budget.elapsed()
        return report.write_json(out, doc)

    def save_all() -> str:
        doc["meta"]["wall_s"] = budget.elapsed()
        return report.write(out, doc)[2]

    rows = Rows(save, save_all)
    log.info("gpu-check on %s, budget %.0f s", doc["meta"]["device_name"], budget.total_s)
    with torch.inference_mode():
        stopped = run_sections(steps(doc, setup, device, real, rows, args), budget, rows,
                               doc["sections"])
    doc["meta"]["stopped"] = stopped
    emit(save_all())
    return verdict(doc, rows, stopped)


def kernels(quick: bool, real: correct.RealModel, device: torch.device) -> list[dict]:
    """The decode attention kernel of every shape the check runs (shapes.decode_kernel)."""
    backend = default_backend(device)
    models = [*shapes.shapes(quick).items(), correct.subject_config(real)]
    return [shapes.decode_kernel(name, cfg, backend) for name, cfg in models]


def verdict(doc: dict, rows: Rows, stopped: str | None) -> int:
    """Exit status: 1 when a greedy run diverged beyond a near-tie, a row or section failed, or
    a CUDA error stopped the check (all of it is in the report), else 0."""
    bugs = [r for r in doc["correctness"]["greedy"] + doc["bench"]["runs"]
            + doc["batched"]["runs"] + doc["findings"]["runs"] if r.get("verdict") == "BUG"]
    if bugs:
        emit(f"error: {len(bugs)} greedy run(s) diverge from ar beyond a near-tie", error=True)
    for line in rows.errors:
        emit(f"error: {line}", error=True)
    if stopped:
        emit(f"error: stopped early: {stopped}", error=True)
    return 1 if bugs or rows.errors or stopped else 0


def new_document(args: argparse.Namespace, setup: dict, info: dict, budget: Budget,
                 real: correct.RealModel) -> dict:
    """gpu-check.json before any section ran: what was asked, on what, and empty sections."""
    return {"meta": {"command": command_line(args), "headline": real.headline(),
                     "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                     "device": info, "device_name": info.get("name"), "torch": torch.__version__,
                     "quick": args.quick, "budget_s": budget.total_s, "dtype": "bf16",
                     "bandwidth_tb_s": args.bandwidth, "plan": setup, "wall_s": 0.0,
                     "stopped": None},
            "sections": {}, "decode": [], "verify": [], "draft": [], "captures": [],
            "paged": [], "paged_identity": [], "backends": [], "early_exit": [],
            "block_mask": [], "pieces": [],
            "correctness": {"greedy": [], "sampling": [], "notes": []},
            "bf16": {"rejection": [], "summary": [], "spread": [], "notes": []},
            "bench": {"runs": [], "summary": [], "notes": []},
            "batched": {"runs": [], "notes": []}, "findings": {"runs": [], "notes": []},
            "notes": []}


def steps(doc: dict, setup: dict, device: torch.device, real: correct.RealModel, rows: Rows,
          args: argparse.Namespace) -> list[tuple[str, Callable[[Section], None] | str]]:
    """The sections in the order they run (budget.SHARES has a share for each, and says why this
    order). A string in place of a step is why the section is skipped."""
    limit = int(args.memory_gib * shapes.GIB) if args.memory_gib else None
    plan = measure.Plan(setup["contexts"], setup["batches"], setup["qs"], setup["ab_contexts"],
                        setup["iters"], args.bandwidth * 1e12, limit)
    models = shapes.shapes(args.quick)

    def on_shapes(what):
        return lambda section: measure.run_shapes(models, device, torch.bfloat16, plan, section,
                                                  doc, rows, what)

    no_model = f"no real model ({real.reason})" if real.path is None and not real.stand_in \
        else None
    return [
        ("shapes", on_shapes(measure.ShapeCheck.main)),
        ("correctness", lambda s: correct.run_correctness(device, real, s, doc["correctness"],
                                                          rows, **setup["correct"])),
        ("bf16", lambda s: bf16.run_bf16(device, real, s, doc["bf16"], rows, **setup["bf16"])),
        ("bench", no_model or (lambda s: correct.run_bench(device, real, s, doc["bench"], rows,
                                                           **setup["bench"]))),
        ("batched", no_model or (lambda s: batched.run_batched(device, real, s, doc["batched"],
                                                               rows, **setup["batched"]))),
        ("findings", no_model or (lambda s: findings.run_findings_section(
            device, real, s, doc["findings"], rows, **setup["findings"]))),
        ("paged", on_shapes(lambda check, s: paged.paged(check, s, **setup["paged"]))),
        ("backends", on_shapes(late.backends)),
        ("drafting", on_shapes(late.drafting)),  # early exit's cost; compute_q_blocks
        # "pieces" stays last: its capture is the one most likely to poison the device.
        ("pieces", on_shapes(late.pieces)),
    ]


def register(sub) -> None:
    add_args(sub.add_parser("gpu-check", help="measure the GPU path (decode vs memory bound, "
                            "verify, draft, backends, correctness) into DIR/gpu-check.json and .md",
                            description=(__doc__ or "").split("\n\n")[0]))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU CI), under a minute")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the whole process, conversion and report included "
                   f"(default {BUDGET_S:.0f}; --quick 60)")
    p.add_argument("--bandwidth", type=float, default=4.3,
                   help="memory bandwidth of the bound, TB/s (H200 copy: 4.3)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="treat the device as having at most this much free memory")
    p.set_defaults(func=cmd_gpu_check)

