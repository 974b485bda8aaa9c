"""Command-line glue for the Ray engine: ``generate --tp K --replicas R`` and ``profile --tp K``.

Kept here so the main cli.py only dispatches: with K * R > 1, generation runs through the
:class:`~knapspec_dist.runtime.engine.Engine`; ``knapspec profile --tp K`` (K > 1) starts one
replica of K shard actors and has them measure the sharded model, including the all-reduce
each sublayer pays (``profiler.measure`` with the replica's process group).
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import asdict

from knapspec_dist.cli.common import add_engine_args

log = logging.getLogger(__name__)


def generate_on_engine(args: argparse.Namespace, texts: list[str], options, config):
    """Prompts through the engine, continuously batched in its replicas; their
    GenerationResults (text filled), in order."""
    from knapspec_dist.runtime.engine import Engine

    fields = {k: v for k, v in asdict(options).items() if k != "name"}
    with Engine(args.model, tp=args.tp, replicas=args.replicas, strategy=options.name,
                dtype=args.dtype, device=args.device, address=args.address,
                cpus_per_rank=args.cpus_per_rank,
                max_num_seqs=getattr(args, "max_num_seqs", None), **fields) as engine:
        return engine.generate(texts, config, chat=args.chat)


def extend_profile(sub) -> None:
    """Add ``--tp`` / ``--address`` / ``--cpus-per-rank`` to ``knapspec profile``."""
    parser = sub.choices.get("profile")
    if parser is None:
        return
    add_engine_args(parser)
    single = parser.get_default("func")

    def cmd(args: argparse.Namespace) -> int:
        if args.replicas != 1:
            from knapspec_dist.errors import UserError

            raise UserError("profile measures one replica: drop --replicas")
        if args.tp == 1 and args.address is None:
            return single(args)
        return profile_on_engine(args)

    parser.set_defaults(func=cmd)


def profile_on_engine(args: argparse.Namespace) -> int:
    from knapspec_dist.cli.profile import check_window, checked_contexts, write
    from knapspec_dist.runtime.engine import Engine

    contexts = checked_contexts(args)
    started = time.perf_counter()
    with Engine(args.model, tp=args.tp, strategy="ar", dtype=args.dtype, device=args.device,
                address=args.address, cpus_per_rank=args.cpus_per_rank) as engine:
        check_window(contexts, engine.config.max_position_embeddings)
        profile = engine.measure_profile(contexts, batch=args.batch, max_q=args.max_q,
                                         repeats=args.repeats, warmup=args.warmup,
                                         fill=args.fill)
    return write(profile, args.out, time.perf_counter() - started)
