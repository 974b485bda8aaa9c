"""Batch jobs: Parquet in, generations plus per-row and per-job speedup statistics out.

Entry points: ``jobs/summarize.py`` and ``jobs/generate.py`` (for ``ray job submit``), the
``knapspec job`` subcommand, and from Python:

>>> from knapspec_dist.jobs import JobConfig, run_job
>>> result = run_job(JobConfig(input="/data/docs.parquet", output="/data/out", model="smollm2"))
>>> speedup = result.summary["baseline"]["speedup"]

The modules, bottom up: :mod:`.options` (JobConfig and the command-line options),
:mod:`.inputs` (read and check the input files), :mod:`.prompts` (rows to prompt ids;
row-level errors; truncation; baseline rows), :mod:`.output` (output schema, atomic part
files, resume), :mod:`.dispatch` (rows over the engine's replicas, retries after replica
failures), :mod:`.progress`, :mod:`.termination` (SIGTERM), :mod:`.summary` (summary.json),
:mod:`.plot` (speedup.png) and :mod:`.runner` (the job from start to end, stage by stage).
The command-line pieces (``main``, ``register``) are here until they move to ``cli/``.
"""

from __future__ import annotations

import argparse
import logging

from knapspec_dist.cli.common import emit
from knapspec_dist.errors import UserError
from knapspec_dist.jobs.options import DEFAULT_INSTRUCTION, JobConfig, add_job_args, config_from_args
from knapspec_dist.jobs.runner import JobResult, JobTerminated, run_job

__all__ = ["DEFAULT_INSTRUCTION", "JobConfig", "JobResult", "JobTerminated", "add_job_args",
           "config_from_args", "main", "register", "run_job", "report"]

log = logging.getLogger(__name__)


def report(result: JobResult) -> str:
    """A few lines for the user: what happened and where the results are."""
    s = result.summary
    rows, base = s["rows"], s["baseline"]
    lines = [
        f"rows: {rows['ok']} ok, {rows['failed']} failed, {rows['pending']} pending "
        f"(of {rows['input']}; this run generated {result.generated}, "
        f"skipped {result.skipped} already written)",
    ]
    tp = s["throughput"]
    if tp["tokens_per_s"]:
        acc = s["acceptance"]["acceptance_rate"]
        lines.append(f"tokens: {s['tokens']['generated']} generated, "
                     f"{tp['tokens_per_s']:.1f} tok/s ({tp['decode_tokens_per_s'] or 0:.1f} "
                     f"without prefill), mean batch {tp['mean_batch'] or 0:.1f} of "
                     f"{tp['max_num_seqs']}"
                     + (f", acceptance {acc:.2f}" if acc is not None else ""))
    if base["speedup"]:
        lines.append(f"speedup vs ar: {base['speedup']:.2f}x measured on {base['rows']} "
                     f"baseline row(s), both passes at mean batch "
                     f"{base['strategy_mean_batch'] or 0:.1f} / {base['ar_mean_batch'] or 0:.1f} "
                     f"(identical tokens: {base['identical_tokens']}/{base['rows']})")
    if result.stopped_early:
        lines.append("stopped early (--stop-after): submit the same job again to continue")
    lines += [f"results: {result.rows_path}", f"summary: {result.summary_path}",
              f"plot:    {result.plot_path}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None, mode: str = "summarize") -> int:
    """``jobs/summarize.py`` / ``jobs/generate.py``: exit 0 when done (rows may have errors),
    2 on a user error (one ``error:`` line), 143 when terminated (SIGTERM), 1 when the job
    could not finish otherwise; resubmit to continue in the last two cases."""
    parser = argparse.ArgumentParser(
        prog=f"{mode}.py",
        description="Summarize documents from Parquet with KnapSpec on Ray" if mode == "summarize"
        else "Generate from Parquet prompts with KnapSpec on Ray")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings only")
    add_job_args(parser, mode)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _run(args, mode)


def _run(args: argparse.Namespace, mode: str) -> int:
    try:
        result = run_job(config_from_args(args, mode))
    except UserError as e:
        emit(f"error: {e}", error=True)
        return 2
    except JobTerminated:
        log.warning("terminated; the rows written so far are kept: resubmit to continue")
        return 143
    emit(report(result))
    return 0


def register(sub) -> None:
    """Add ``knapspec job`` to the CLI's subparsers."""
    p = sub.add_parser("job", help="batch job: Parquet in, generations + speedup statistics out",
                       description="Run the summarization batch job (as jobs/summarize.py) "
                                   "in this process, on the Ray cluster given by --address or "
                                   "RAY_ADDRESS, else on a new local Ray.")
    add_job_args(p, "summarize")
    p.set_defaults(func=_cli_job)


def _cli_job(args: argparse.Namespace) -> int:
    if not args.verbose:  # progress lines are the point of a batch job
        logging.getLogger("knapspec_dist.jobs").setLevel(logging.INFO)
        if not logging.getLogger().handlers:
            logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = run_job(config_from_args(args, "summarize"))  # UserError: handled by the CLI
    emit(report(result))
    return 0
