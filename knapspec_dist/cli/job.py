"""``knapspec job``: the summarization batch job (as ``jobs/summarize.py``) in this process,
on the Ray cluster given by ``--address`` or ``RAY_ADDRESS``, else on a new local Ray."""

from __future__ import annotations

import argparse
import logging

from knapspec_dist.cli.common import emit
from knapspec_dist.jobs import add_job_args, config_from_args, report, run_job


def register(sub) -> None:
    p = sub.add_parser("job", help="batch job: Parquet in, generations + speedup statistics out",
                       description="Run the summarization batch job (as jobs/summarize.py) "
                                   "in this process, on the Ray cluster given by --address or "
                                   "RAY_ADDRESS, else on a new local Ray.")
    add_job_args(p, "summarize")
    p.set_defaults(func=cmd_job)


def cmd_job(args: argparse.Namespace) -> int:
    if not args.verbose:  # progress lines are the point of a batch job
        logging.getLogger("knapspec_dist.jobs").setLevel(logging.INFO)
        if not logging.getLogger().handlers:
            logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = run_job(config_from_args(args, "summarize"))  # UserError: handled by main
    emit(report(result))
    return 0
