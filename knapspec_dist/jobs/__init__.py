"""Batch jobs: Parquet in, generations plus per-row and per-job speedup statistics out.

Entry points: ``jobs/summarize.py`` and ``jobs/generate.py`` (for ``ray job submit``), the
``knapspec job`` subcommand, and from Python:

>>> from knapspec_dist.jobs import JobConfig, run_job
>>> result = run_job(JobConfig(input="/data/docs.parquet", output="/data/out", model="smollm2"))
>>> speedup = result.summary["baseline"]["speedup"]

The job wraps the runtime's one pipeline (runtime/stages.py: the processor's tokenize stage,
the dispatcher over the replicas, the result columns) with what Ray Data LLM lacks. The
modules, bottom up: :mod:`.options` (JobConfig and the command-line options),
:mod:`.inputs` (read and check the input files), :mod:`.parts` and :mod:`.output` (output
schema, atomic part files, reading parts one row per id), :mod:`.resume` (done ids by an
Arrow anti-join), :mod:`.lease` (one job per output directory), :mod:`.baseline` (which rows
the baseline passes run), :mod:`.progress`, :mod:`.termination` (SIGTERM), :mod:`.summary`
(summary.json, streamed over the parts), :mod:`.plot` (speedup.png), :mod:`.report` (the
lines a user reads), :mod:`.passes` (the generation passes) and :mod:`.runner` (the job
from start to end, stage by stage). Its command line (``knapspec job``, and ``main`` of
``jobs/summarize.py`` / ``jobs/generate.py``) is cli/job.py.
"""

from __future__ import annotations

from knapspec_dist.jobs.options import DEFAULT_INSTRUCTION, JobConfig
from knapspec_dist.jobs.report import report
from knapspec_dist.jobs.runner import JobResult, JobTerminated, run_job

__all__ = ["DEFAULT_INSTRUCTION", "JobConfig", "JobResult", "JobTerminated", "report", "run_job"]
