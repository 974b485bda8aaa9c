"""What the commands share: the one place they print, the argument groups, and the option
objects built from parsed arguments.

The bottom of the command layer: every ``cli/`` command module (and, until it has its own,
``jobs/options.py``) builds on it, and it imports nothing above the engine and the strategy
options, so sharing it pulls in no command.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
from dataclasses import replace
from pathlib import Path

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.sampling import METHODS
from knapspec_dist.errors import Stopped, UserError
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.model.embedded import resolve_model_path
from knapspec_dist.model.weights import load_model, resolve_device, resolve_dtype
from knapspec_dist.option_rules import rule
from knapspec_dist.speculation.options import NAMES, StrategyOptions, parse_strategy

log = logging.getLogger(__name__)


def emit(text: str, *, error: bool = False) -> None:
    """A command's final report (stdout) or error line (stderr): the one place commands print;
    progress and diagnostics go through logging."""
    stream = sys.stderr if error else sys.stdout
    stream.write(f"{text}\n")
    stream.flush()


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a value that starts with ``-`` and a digit, ``inf`` or ``nan``
    (``--temperature -inf``, ``--seed -1e400``) is the option's value, which its rule then
    refuses in one line, not an unknown option argparse reports with its usage."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\.?\d|inf|nan)", re.IGNORECASE)


def command_parser(prog: str, description: str, commands) -> argparse.ArgumentParser:
    """A parser with one subcommand per module in ``commands``, in that order: each module's
    ``register(subparsers)`` owns its options, so every entry point offers the same ones."""
    p = Parser(prog=prog, description=description)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in commands:
        command.register(sub)
    return p


def run(p: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse and run a command: user errors (bad path, config, prompt, option value) print one
    ``error: ...`` line and exit 2, with no traceback; SIGTERM / SIGINT one warning line and
    exit 143 / 130; anything else is a bug and keeps its traceback."""
    p.add_argument("-v", "--verbose", action="store_true")
    try:
        args = p.parse_args(argv)  # a numeric option's rule refuses its value here
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return args.func(args)
    except UserError as e:
        emit(f"error: {e}", error=True)
        return 2
    except Stopped as e:  # a job's SIGTERM / SIGINT, in any command (demo, bench, ...)
        return stopped(e.signum)
    except KeyboardInterrupt:
        return stopped(signal.SIGINT)


def add_number(p, option: str, **kwargs) -> None:
    """A numeric option of ``p`` (a parser or group), parsed by its rule in the one table
    (option_rules.py): a bad value raises UserError from ``parse_args``, which the entry
    points turn into one ``error:`` line, before anything runs."""
    p.add_argument(option, type=rule(option), **kwargs)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="model folder, or 'smollm2' (embedded)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])


def add_strategy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default="knapspec",
                   help=f"{', '.join(NAMES)}, with flags as in the bench: knapspec:paper, "
                        f"knapspec:paper+coupled, static:a3,m5@4, clasp@4")
    p.add_argument("--skip", default="", help="static: skipped sublayers, e.g. a3,a5,m7 (0-based)")
    add_number(p, "--gamma", default=4, help="static / clasp draft length")
    add_number(p, "--tau-conf", default=0.7, help="draft confidence early exit")
    p.add_argument("--profile", default=None, help="latency profile JSON (knapspec, clasp)")
    add_number(p, "--interval", default=64,
               help="tokens between re-selections (knapspec:paper: rounds)")
    p.add_argument("--coupled", action="store_true", help="skip attention+MLP of a layer together")
    p.add_argument("--objective", default="tpt", choices=["tpt", "alpha"])
    p.add_argument("--select-once", action="store_true", help="select after prefill only")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    add_number(p, "--max-new-tokens", default=128)
    add_draw_args(p)


def add_draw_args(p: argparse.ArgumentParser, seed: int | None = None) -> None:
    """How tokens are drawn: greedy by default; the bench and throughput commands, which
    generate a set number of tokens, take these without ``--max-new-tokens``."""
    add_number(p, "--temperature", default=0.0, help="0 = greedy")
    add_number(p, "--top-p", default=1.0)
    add_number(p, "--top-k", default=0)
    add_number(p, "--seed", default=seed)
    p.add_argument("--sampling", default="coupled", choices=list(METHODS),
                   help="how sampled drafts are verified: coupled (the tokens of plain "
                        "sampling, whatever the batch: reproducible with --seed) or rejection "
                        "(plain sampling's distribution, accepting more drafts; not "
                        "reproducible run to run, even with --seed: its tokens depend on the "
                        "rounds, which timing and the batch decide; docs/sampling.md)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """``--tp`` / ``--replicas`` / ``--address`` / ``--cpus-per-rank``: the Ray engine (every
    command that starts one, the batch job included, takes these same four)."""
    run = p.add_argument_group("cluster")
    add_number(run, "--tp", default=1,
               help="tensor-parallel degree per replica (generate: the Ray engine if > 1)")
    add_number(run, "--replicas", default=1,
               help="model replicas, TP groups (generate: the Ray engine if > 1)")
    run.add_argument("--address", default=None,
                     help="Ray address ('auto' joins a running cluster; default: the job's "
                          "cluster (RAY_ADDRESS), else a new local Ray)")
    add_number(run, "--cpus-per-rank", default=None,
               help="CPUs reserved per tensor-parallel rank; on a CPU also its torch "
                    "threads (default: the cluster's cores shared by every rank)")


def uses_engine(args: argparse.Namespace) -> bool:
    """Whether a command runs on the Ray engine (tp x replicas > 1, or a Ray address)."""
    return args.tp * args.replicas > 1 or args.address is not None


def strategy_options(args: argparse.Namespace) -> StrategyOptions:
    """The one translation of :func:`add_strategy_args`' arguments into options."""
    named = parse_strategy(args.strategy, args.skip).options  # flags in the name add to them
    default_gamma = StrategyOptions().gamma
    return replace(named, skip=named.skip or args.skip,
                   gamma=named.gamma if args.gamma == default_gamma else args.gamma,
                   tau_conf=args.tau_conf, profile=args.profile, interval=args.interval,
                   coupled=named.coupled or args.coupled,
                   objective="alpha" if "alpha" in (named.objective, args.objective) else "tpt",
                   select_once=named.select_once or args.select_once)


def generation_config(args: argparse.Namespace, max_new_tokens: int | None = None,
                      stop_at_eos: bool = True) -> GenerationConfig:
    """:func:`add_sampling_args`' (or :func:`add_draw_args`' and ``max_new_tokens``)
    arguments, through the one builder."""
    return GenerationConfig.of(
        max_new_tokens=args.max_new_tokens if max_new_tokens is None else max_new_tokens,
        stop_at_eos=stop_at_eos, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, sampling=args.sampling)


def parse_ints(text: str, what: str) -> list[int]:
    """``"1,8"`` -> [1, 8] for the option ``what``; anything but positive integers is a
    UserError."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{what}: expected positive integers, got {text!r}")
    return values


def existing_model_path(name: str) -> Path:
    """The folder of ``--model`` (a path, or an embedded name), which must exist."""
    path = resolve_model_path(name)
    if not path.exists():
        raise UserError(f"model path {str(path)!r} does not exist")
    return path


def load_model_args(path: Path, args: argparse.Namespace) -> Transformer:
    """The model at ``path`` in :func:`add_model_args`' dtype, on its device."""
    return load_model(path, dtype=resolve_dtype(args.dtype), device=resolve_device(args.device))


def stopped(signum: int) -> int:
    """One warning line for a job stopped by a signal; the exit code the shell reports."""
    what = "interrupted" if signum == signal.SIGINT else "terminated"
    log.warning("%s (%s): the finished rows are written and kept; run the same job again to "
                "continue", what, signal.Signals(signum).name)
    return Stopped.exit_code(signum)
