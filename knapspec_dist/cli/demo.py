"""``knapspec demo``: the summarization batch job on the bundled sample chapters, with
smollm2 on a local Ray -- what ``make demo`` runs."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from knapspec_dist.cli.common import add_number
from knapspec_dist.jobs import JobConfig, report, run_job
from knapspec_dist.tools.corpus import bundled_sample_path

# Seeded sampling, not greedy: greedy decoding of a 135M model loops ("The previous day was a
# very different thing from the previous day..."). The instruction after the chapter, not
# before it: with it first, SmolLM2 often answered as an editor and 3-7 of the 12 rows
# repeated a sentence under every sampling setting tried; with it last, 0 of 12 at 0.7 / 0.9
# (scripts/check_demo_summaries.py, tools/repeats.py; docs/sampling.md). It stays
# lossless: every strategy emits plain sampling's tokens for the same seed.
DEMO_TEMPERATURE, DEMO_TOP_P = 0.7, 0.9
DEMO_INSTRUCTION = "{document}\n\nSummarize the document above in a few sentences."


def register(sub) -> None:
    d = sub.add_parser("demo", help="run the summarization batch job on the bundled chapters "
                                    "(smollm2, local Ray)")
    add_number(d, "--max-new-tokens", default=96)
    add_number(d, "--temperature", default=DEMO_TEMPERATURE,
               help="0 for greedy (SmolLM2-135M's greedy summaries loop)")
    add_number(d, "--seed", default=0)
    d.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    out = Path("outputs") / time.strftime("demo-%Y%m%d-%H%M%S")
    logging.getLogger("knapspec_dist.jobs").setLevel(logging.INFO)  # progress lines
    print(f"summarizing the 12 chapters (1-6k tokens each) of {bundled_sample_path()} with "
          f"smollm2 (knapspec, {args.max_new_tokens} new tokens each, sampled at temperature "
          f"{args.temperature}, top-p {DEMO_TOP_P}, with seed {args.seed}, plus one row with "
          f"ar for the speedup) on a local Ray: several minutes on a laptop CPU; results go "
          f"to {out}/",
          file=sys.stderr)
    result = run_job(JobConfig(input=str(bundled_sample_path()), output=str(out.resolve()),
                               model="smollm2", strategy="knapspec",
                               instruction=DEMO_INSTRUCTION, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_p=DEMO_TOP_P, seed=args.seed))
    rows = pq.read_table(result.rows_path, columns=["id", "generated_text", "error"]).to_pylist()
    first = next((r for r in sorted(rows, key=lambda r: r["id"])
                  if r["error"] is None and r["generated_text"].strip()), None)
    if first is not None:
        print(f"--- {first['id']}:\n{first['generated_text'].strip()}\n---")
    print(report(result))
    return 0
