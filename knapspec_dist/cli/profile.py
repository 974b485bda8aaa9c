"""``knapspec profile``: measure a latency profile and write it as JSON.

In process by default; ``--tp K`` (or ``--address``) starts one replica of K shard actors on
the Ray engine and has them measure the sharded model, including the all-reduce each sublayer
pays.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from knapspec_dist.cli.common import (
    add_engine_args,
    add_model_args,
    emit,
    load_model_args,
)
from knapspec_dist.errors import UserError
from knapspec_dist.model.embedded import resolve_model_path
from knapspec_dist.profiles.profile import KV_LAYOUTS, LatencyProfile
from knapspec_dist.profiles.profiler import DEFAULT_CONTEXTS, DEFAULT_MAX_Q, measure
from knapspec_dist.profiles.store import unsteady
from knapspec_dist.runtime.ray_engine import RayEngine


def parse_contexts(text: str) -> list[int]:
    """``"256,1024,4k"`` -> [256, 1024, 4096]; anything else is a UserError."""
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        mult = 1
        if part[-1] in "kK":
            part, mult = part[:-1], 1024
        try:
            n = int(part) * mult
        except ValueError:
            raise UserError(f"--contexts: {part!r} is not an integer context length "
                            f"(expected e.g. 256,1024,4096)") from None
        if n < 1:
            raise UserError(f"--contexts: context lengths must be >= 1, got {n}")
        out.append(n)
    if not out:
        raise UserError("--contexts: give at least one context length, e.g. 256,1024,4096")
    return sorted(set(out))


def output_path(out: str, profile: LatencyProfile) -> Path:
    """``--out``: a directory (existing, or written with a trailing slash) gets ``<key>.json``."""
    path = Path(out).expanduser()
    if path.is_dir() or str(out).endswith(("/", os.sep)):
        return path / f"{profile.key()}.json"
    return path


def register(sub) -> None:
    """Add ``knapspec profile`` to the CLI's subparsers."""
    p = sub.add_parser("profile",
                       help="measure a latency profile (sublayers, head, verify) to JSON",
                       description="Measure per-sublayer decode latency against context length, "
                                   "the head, and the verify cost of q tokens; fit and write JSON.")
    add_model_args(p)
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)),
                   help="comma-separated context lengths (default %(default)s)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-q", type=int, default=DEFAULT_MAX_Q, help="verify q = 1..max-q tokens")
    p.add_argument("--repeats", type=int, default=5, help="timings per point; the median is kept")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of every shape first")
    p.add_argument("--fill", default="random", choices=["random", "prefill"],
                   help="KV cache contents: random K/V (default) "
                        "or a real prefill of random tokens")
    p.add_argument("--kv", default="fixed", choices=list(KV_LAYOUTS),
                   help="the KV cache measured over: fixed slots (default) or paged, as a "
                        "replica with a paged cache decodes")
    p.add_argument("--page-size", type=int, default=None,
                   help="with --kv paged: positions per page (default: the backend's, "
                        "16 under sdpa, 128 under flex)")
    p.add_argument("--out", required=True,
                   help="output JSON file, or a directory (file named by key)")
    add_engine_args(p)  # --tp / --address: measure on the Ray engine
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    if args.replicas != 1:
        raise UserError("profile measures one replica: drop --replicas")
    if args.tp == 1 and args.address is None:
        return profile_in_process(args)
    return profile_on_engine(args)


def profile_in_process(args: argparse.Namespace) -> int:
    contexts = checked_contexts(args)
    model = load_model_args(resolve_model_path(args.model), args)
    check_window(contexts, model.cfg.max_position_embeddings)
    started = time.perf_counter()
    profile = measure(model, contexts, args.batch, args.max_q, args.repeats, warmup=args.warmup,
                      fill=args.fill, kv=args.kv, page=args.page_size)
    return write(profile, args.out, time.perf_counter() - started)


def profile_on_engine(args: argparse.Namespace) -> int:
    """One replica of ``--tp`` shard actors measures the sharded model."""
    contexts = checked_contexts(args)
    started = time.perf_counter()
    with RayEngine(args.model, tp=args.tp, strategy="ar", dtype=args.dtype, device=args.device,
                address=args.address, cpus_per_rank=args.cpus_per_rank) as engine:
        check_window(contexts, engine.config.max_position_embeddings)
        profile = engine.measure_profile(contexts, batch=args.batch, max_q=args.max_q,
                                         repeats=args.repeats, warmup=args.warmup,
                                         fill=args.fill, kv=args.kv, page=args.page_size)
    return write(profile, args.out, time.perf_counter() - started)


def checked_contexts(args: argparse.Namespace) -> list[int]:
    """The command's numeric arguments, checked; the sorted context lengths."""
    contexts = parse_contexts(args.contexts)
    for name in ("batch", "max_q", "repeats", "page_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    return contexts


def check_window(contexts: list[int], limit: int) -> None:
    if contexts[-1] > limit:
        raise UserError(f"--contexts: {contexts[-1]} exceeds the model's context length {limit}")


def write(profile: LatencyProfile, out_arg: str, seconds: float) -> int:
    """Save where ``--out`` says and print the fitted coefficients."""
    out = output_path(out_arg, profile)
    try:
        profile.save(out)
    except OSError as e:
        raise UserError(f"cannot write profile to {str(out)!r}: {e.strerror or e}") from None
    emit(summary(profile, out, seconds))
    return 0


def summary(profile: LatencyProfile, path: Path | str, seconds: float) -> str:
    """Human-readable fitted coefficients (what the CLI prints after writing the file)."""
    a = profile.attention
    ns = sorted({int(n) for n, _ in profile.samples["attention"]})
    lines = [f"wrote {path} ({seconds:.0f}s, device {profile.device.get('name')}, {profile.dtype}, "
             f"batch {profile.batch}, tp {profile.tp}, {profile.kv} KV)",
             f"  t_attn(n) = {a.slope * 1e6:.4f} us * n + {a.intercept * 1e3:.4f} ms",
             f"  t_mlp     = {profile.mlp * 1e3:.4f} ms",
             f"  t_head    = {profile.head * 1e3:.4f} ms"]
    spread = profile.spread()
    if spread is not None:
        lines.append(f"  repeats' relative spread (max - min) / median: {spread:.2f}, median over "
                     f"the points")
    busy = unsteady(profile)
    if busy:
        lines.append(f"  busy machine: {busy}; a job would not cache this profile: measure "
                     f"again on an idle machine")
    load = profile.device.get("load_average")
    if load:
        lines.append(f"  load average while measuring: {load[0]} -> {load[1]} "
                     f"(on {profile.device.get('logical_cpus', '?')} logical CPUs)")
    qs = sorted(profile.verify)
    for n in ns:
        vals = ", ".join(f"{q}:{profile.verify_time(q, n) * 1e3:.1f}" for q in qs)
        lines.append(f"  t_verify(q, n={n}) ms  {vals}")
    if profile.tp > 1:
        lines.append(f"  all-reduce per sublayer = {profile.allreduce * 1e6:.1f} us")
    return "\n".join(lines)
