"""Shared command-line pieces: the one place commands print, the argument groups every
command uses, and the option objects built from them.

The bottom of the command layer: ``cli.py``, ``jobs/``, ``bench/``, ``profiles/command.py``
and ``runtime/cli.py`` import from here, and this module imports nothing above the engine
(only the strategy factory and the sampling / generation configs, lazily).
"""

from __future__ import annotations

import argparse
import sys


def emit(text: str, *, error: bool = False) -> None:
    """A command's final report (stdout) or error line (stderr): the one place commands print;
    progress and diagnostics go through logging."""
    stream = sys.stderr if error else sys.stdout
    stream.write(f"{text}\n")
    stream.flush()


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="model folder, or 'smollm2' (embedded)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])


def add_strategy_args(p: argparse.ArgumentParser) -> None:
    from knapspec_dist.spec.options import NAMES

    p.add_argument("--strategy", default="knapspec", choices=NAMES)
    p.add_argument("--skip", default="", help="static: skipped sublayers, e.g. a3,a5,m7 (0-based)")
    p.add_argument("--gamma", type=int, default=4, help="static / clasp draft length")
    p.add_argument("--tau-conf", type=float, default=0.7, help="draft confidence early exit")
    p.add_argument("--profile", default=None, help="latency profile JSON (knapspec, clasp)")
    p.add_argument("--interval", type=int, default=64, help="tokens between re-selections")
    p.add_argument("--coupled", action="store_true", help="skip attention+MLP of a layer together")
    p.add_argument("--objective", default="tpt", choices=["tpt", "alpha"])
    p.add_argument("--select-once", action="store_true", help="select after prefill only")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """``--tp`` / ``--replicas`` / ``--address`` / ``--cpus-per-rank``: the Ray engine."""
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (Ray engine if > 1)")
    p.add_argument("--replicas", type=int, default=1, help="model replicas (Ray engine if > 1)")
    p.add_argument("--address", default=None,
                   help="Ray address ('auto' joins a running cluster; default: start a local one)")
    p.add_argument("--cpus-per-rank", type=int, default=1,
                   help="CPUs reserved per rank, and its torch threads")


def uses_engine(args: argparse.Namespace) -> bool:
    """Whether a command runs on the Ray engine (tp x replicas > 1, or a Ray address)."""
    return getattr(args, "tp", 1) * getattr(args, "replicas", 1) > 1 or \
        getattr(args, "address", None) is not None


def strategy_options(args: argparse.Namespace):
    """The :class:`~knapspec_dist.spec.factory.StrategyOptions` of the parsed args."""
    from knapspec_dist.spec.options import StrategyOptions

    return StrategyOptions(name=args.strategy, skip=args.skip, gamma=args.gamma,
                           tau_conf=args.tau_conf, profile=args.profile, interval=args.interval,
                           coupled=args.coupled, objective=args.objective,
                           select_once=args.select_once)


def generation_config(args: argparse.Namespace):
    from knapspec_dist.engine.sampling import SamplingConfig
    from knapspec_dist.engine.generation import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingConfig(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed))
