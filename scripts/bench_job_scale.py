#!/usr/bin/env python
"""Scale benchmark of the batch job: N long documents in, the driver's time to its first
written row, its peak RSS and the rows per second it sustains.

    python scripts/bench_job_scale.py --docs 2000 20000            # stub engine + SmolLM2 ar

For each N it writes a synthetic input (N documents of ``--chars`` characters, slices of
the shared corpus, in Parquet files of 1,000 rows) and runs ``run_job`` on it, each run in
a fresh process (its peak RSS is the driver's: Ray's workers are other processes):

* ``stub``: the stub engine of tests/stub_engine.py (a row returns ``--delay`` seconds after
  it started, ``--max-num-seqs`` rows at a time): the job layer's own speed, the input
  streamed and tokenized by Ray Data with SmolLM2's tokenizer as in a real job;
* ``tiny``: the same stub on N one-line prompts: the job layer without tokenizing work;
* ``ar``: SmolLM2 with ``ar`` for ``--ar-rows`` rows (``--stop-after``): a real model.

Prints one JSON line per run and a Markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from knapspec_dist.jobs import JobConfig, run_job  # noqa: E402
from knapspec_dist.tools.corpus import AUSTEN_BOOKS, book_path  # noqa: E402

from stub_engine import StubBackend, StubEngines  # noqa: E402

log = logging.getLogger("bench_job_scale")


def write_input(folder: str, n: int, chars: int, tiny: bool) -> str:
    """N documents: ``chars``-character slices of the six novels at spread offsets (or one
    short line each), 1,000 rows a file, 100 rows a row group."""
    os.makedirs(folder, exist_ok=True)
    paths = [book_path(b) or book_path(b, "/work/shared/corpus") for b in AUSTEN_BOOKS]
    if None in paths:
        raise SystemExit("the shared corpus is not found: set KNAPSPEC_CORPUS")
    text = "".join(open(path, encoding="utf-8").read() for path in paths)
    step = max(1, (len(text) - chars) // max(n, 1))
    for start in range(0, n, 1000):
        ids = [f"doc-{i:07d}" for i in range(start, min(n, start + 1000))]
        docs = [f"Document {i}." if tiny else text[(i * step) % (len(text) - chars):][:chars]
                for i in range(start, start + len(ids))]
        pq.write_table(pa.table({"id": ids, "document": docs}),
                       os.path.join(folder, f"part-{start // 1000:05d}.parquet"),
                       row_group_size=100)
    return folder


#: Log lines that end a stage before the first row, and the stage's name in the JSON line.
MARKS = {"input: ": "input_checked_s", "Started a local Ray": "ray_started_s",
         "generating ": "first_batch_s"}


class StageTimes(logging.Handler):
    """Seconds from ``t0`` to the first log line of each of :data:`MARKS`."""

    def __init__(self, t0: float):
        super().__init__(logging.INFO)
        self.t0, self.at = t0, {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for mark, name in MARKS.items():
            if name not in self.at and message.startswith(mark):
                self.at[name] = round(time.monotonic() - self.t0, 1)


def child(args) -> None:
    """One measured run in this process; prints its JSON line."""
    times: list[float] = []
    t0 = time.monotonic()
    stages = StageTimes(t0)
    logging.getLogger().addHandler(stages)
    logging.getLogger("ray").addHandler(stages)  # Ray's logger does not propagate to root
    config = JobConfig(input=args.input, output=args.output, model="smollm2",
                       strategy="ar", max_new_tokens=args.new_tokens, baseline_fraction=0,
                       truncate=True, checkpoint_rows=256, checkpoint_seconds=5,
                       max_num_seqs=args.max_num_seqs if args.kind != "ar" else None,
                       stop_after=args.ar_rows if args.kind == "ar" else args.stub_rows,
                       progress_seconds=10, progress_bar=False, address="local")
    kw = {}
    if args.kind != "ar":
        kw = dict(engine_factory=StubEngines(args.delay, args.max_num_seqs),
                  backend_factory=StubBackend)
    result = run_job(config, on_row=lambda row: times.append(time.monotonic()), **kw)
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    print(json.dumps({"kind": args.kind, "docs": args.n, "rows": len(times),
                      "first_row_s": times[0] - t0 if times else None,
                      "rows_per_s": rate, "wall_s": time.monotonic() - t0,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "complete": result.summary["complete"], **stages.at}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, nargs="+", default=[2000, 20000])
    p.add_argument("--chars", type=int, default=16000)
    p.add_argument("--kinds", nargs="+", default=["stub", "tiny", "ar"])
    p.add_argument("--delay", type=float, default=0.05, help="stub: seconds a row takes")
    p.add_argument("--max-num-seqs", type=int, default=64, help="stub: rows at once")
    p.add_argument("--ar-rows", type=int, default=8, help="ar: rows generated (--stop-after)")
    p.add_argument("--stub-rows", type=int, default=None,
                   help="stub, tiny: stop after this many rows (1: the time to the first row "
                        "only; default: all, for rows/s)")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--work", default=None, help="folder for inputs and outputs (default: tmp)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--input", help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.child:
        child(args)
        return
    work = args.work or tempfile.mkdtemp(prefix="job-scale-")
    results = []
    for n in args.docs:
        for kind in args.kinds:
            tiny = kind == "tiny"
            folder = os.path.join(work, f"in-{'tiny' if tiny else 'long'}-{n}")
            if not os.path.isdir(folder):
                log.info("writing %d %s documents to %s", n, "tiny" if tiny else "long", folder)
                write_input(folder + ".tmp", n, args.chars, tiny)
                os.rename(folder + ".tmp", folder)
            out = os.path.join(work, f"out-{kind}-{n}-{time.time_ns()}")
            cmd = [sys.executable, __file__, "--child", "--kind", kind, "--n", str(n),
                   "--input", folder, "--output", out, "--delay", str(args.delay),
                   "--max-num-seqs", str(args.max_num_seqs), "--ar-rows", str(args.ar_rows),
                   "--new-tokens", str(args.new_tokens)]
            if args.stub_rows is not None:
                cmd += ["--stub-rows", str(args.stub_rows)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode or not lines:
                log.error("%s N=%d failed (exit %d):\n%s", kind, n, proc.returncode,
                          proc.stderr[-3000:])
                continue
            results.append(json.loads(lines[-1]))
            print(lines[-1], flush=True)
    print(f"\n{platform.node()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}\n")
    print("| engine | documents | rows | time to first row | driver peak RSS | rows/s | "
          "stages: input checked, Ray up, first batch (s) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        marks = ", ".join(str(r.get(name, "-")) for name in MARKS.values())
        print(f"| {r['kind']} | {r['docs']:,} | {r['rows']:,} | {r['first_row_s']:.1f} s | "
              f"{r['peak_rss_mib']:,.0f} MiB | {r['rows_per_s'] or 0:,.1f} | {marks} |")


if __name__ == "__main__":
    main()
