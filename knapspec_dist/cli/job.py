"""The batch job's command line: ``knapspec job`` (the summarization job in this process, on
the Ray cluster given by ``--address`` or ``RAY_ADDRESS``, else on a new local Ray) and
``main``, the entry point of ``jobs/summarize.py`` and ``jobs/generate.py``."""

from __future__ import annotations

import argparse
import logging
import signal

from knapspec_dist.cli.common import (
    Parser,
    add_engine_args,
    add_model_args,
    add_number,
    add_sampling_args,
    add_strategy_args,
    emit,
    stopped,
    strategy_options,
)
from knapspec_dist.engine.memory import MEMORY_UTILIZATION
from knapspec_dist.errors import UserError
from knapspec_dist.jobs import (
    DEFAULT_INSTRUCTION,
    JobConfig,
    JobTerminated,
    report,
    run_job,
)
from knapspec_dist.runtime.prompts import CHUNK_INSTRUCTION, COMBINE_INSTRUCTION

log = logging.getLogger(__name__)


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
    return _stoppable(args, "summarize")  # UserError: handled by cli/main.py


def main(argv: list[str] | None = None, mode: str = "summarize") -> int:
    """``jobs/summarize.py`` / ``jobs/generate.py``: exit 0 when done (rows may have errors),
    2 on a user error (one ``error:`` line), 143 when terminated (SIGTERM), 130 when
    interrupted (SIGINT, Ctrl-C), 1 when the job could not finish otherwise; resubmit to
    continue in the last three cases."""
    parser = Parser(
        prog=f"{mode}.py",
        description="Summarize documents from Parquet with KnapSpec on Ray" if mode == "summarize"
        else "Generate from Parquet prompts with KnapSpec on Ray")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings only")
    add_job_args(parser, mode)
    try:
        args = parser.parse_args(argv)  # a numeric option's rule refuses its value here
        logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return _stoppable(args, mode)
    except UserError as e:
        emit(f"error: {e}", error=True)
        return 2


def _stoppable(args: argparse.Namespace, mode: str) -> int:
    """The job and its report; SIGTERM / SIGINT end it with one warning line (the rows
    written so far are kept) and exit 143 / 130, as the shell reports a signal."""
    try:
        result = run_job(config_from_args(args, mode))
    except JobTerminated as e:
        return stopped(e.signum)
    except KeyboardInterrupt:  # Ctrl-C before the job's handler was in place, or a second one
        return stopped(signal.SIGINT)
    emit(report(result))
    return 0


def add_job_args(p: argparse.ArgumentParser, mode: str = "summarize") -> None:
    """The options of ``jobs/summarize.py`` (``mode='summarize'``) or ``jobs/generate.py``."""
    io = p.add_argument_group("input and output")
    io.add_argument("--input", required=True,
                    help="Parquet file, directory or glob; a local path or a URI pyarrow reads "
                         "(s3://, gs://, hdfs://, file://). Paths are resolved on the driver: "
                         "use absolute paths or URIs with `ray job submit`")
    io.add_argument("--output", required=True,
                    help="output directory (local or URI): rows/ and baseline/ Parquet parts, "
                         "summary.json, speedup.png. Re-running into it resumes the job")
    io.add_argument("--id-column", default="id", help="unique row id (default: id)")
    src = io.add_mutually_exclusive_group()
    if mode == "summarize":
        src.add_argument("--text-column", default=None,
                         help="document column; the prompt is the model's chat template around "
                              "--instruction and the document (default: document)")
        src.add_argument("--prompt-column", default=None, help="prompt column, used as is")
        io.add_argument("--instruction", default=DEFAULT_INSTRUCTION,
                        help="instruction before the document, or around it where it says "
                             f"{{document}} (default: {DEFAULT_INSTRUCTION!r})")
    else:
        src.add_argument("--prompt-column", default=None,
                         help="prompt column, used as is (default: prompt)")
        src.add_argument("--text-column", default=None,
                         help="message column: wrapped as a user message in the chat template")
        io.add_argument("--instruction", default="",
                        help="text put before each --text-column message (default: none)")
    add_model_args(p)
    add_engine_args(p)
    add_strategy_args(p)
    add_sampling_args(p)
    rows = p.add_argument_group("rows")
    rows.add_argument("--truncate", action="store_true",
                      help="cut over-long documents to fit the context window (the end of the "
                           "document, or of a --prompt-column prompt, is dropped); the same "
                           "as --long-documents truncate")
    rows.add_argument("--long-documents", choices=("tree", "truncate", "fail"), default=None,
                      help="a --text-column document past the window: tree (summarize its "
                           "chunks, then their summaries, until one is left), truncate or "
                           "fail the row (default: tree for the summarization job, else fail)")
    add_number(rows, "--chunk-tokens", default=None,
               help="a tree's chunk, in document tokens, cut at a paragraph break, else "
                    "a sentence end (default: 2048, or half of what a chunk's prompt leaves where "
                    "that is less)")
    add_number(rows, "--chunk-overlap", default=0,
               help="tokens of a chunk's predecessor repeated at its start (default 0)")
    add_number(rows, "--tree-depth", default=8,
               help="most levels of a tree, its chunks' included; a document that "
                    "needs more fails (default 8)")
    add_number(rows, "--tree-fan-in", default=None,
               help="most summaries one group of a tree combines (default: as many as fit "
                    "the window)")
    rows.add_argument("--chunk-instruction", default=CHUNK_INSTRUCTION,
                      help="a chunk's prompt: {document} where its text goes (else before "
                           "it); {part} and {parts} say which part of how many it is")
    rows.add_argument("--combine-instruction", default=COMBINE_INSTRUCTION,
                      help="the prompt that combines summaries: {document} where they go "
                           "(else before them)")
    add_number(rows, "--max-model-len", default=None,
               help="longest row to allow (prompt + new tokens), which the KV cache "
                    "must hold; default and maximum: the model's context window")
    add_number(rows, "--baseline-fraction", default=0.05,
               help="share of rows run again, with the job's strategy and with `ar`, "
                    "to measure the speedup (at least one row; 0 turns the baseline "
                    "off; default 0.05)")
    sched = p.add_argument_group("scheduling and checkpoints")
    add_number(sched, "--max-num-seqs", default=None,
               help="cap on the rows each replica has in flight, continuously batched "
                    "as the KV cache allows (default 256 on a GPU, 16 on a CPU)")
    add_number(sched, "--kv-cache-memory", metavar="SIZE",
               help="KV cache per rank, whole bytes or a number with a unit (2GiB, 1.5GB); "
                    "default: --memory-utilization of the memory free after the "
                    "weights load")
    add_number(sched, "--memory-utilization", default=MEMORY_UTILIZATION,
               help="share of the memory free after the weights that the KV cache "
                    f"takes when --kv-cache-memory is not given (default "
                    f"{MEMORY_UTILIZATION})")
    add_number(sched, "--max-num-batched-tokens", default=None,
               help="prompt tokens each replica prefills per step; a longer prompt is "
                    "prefilled in chunks across steps (default: 8192 on a GPU, 2048 "
                    "on a CPU)")
    add_number(sched, "--max-inflight", default=None,
               help="rows outstanding per replica (default: max-num-seqs + 2, so a "
                    "freed slot is refilled at once)")
    add_number(sched, "--max-attempts", default=3,
               help="replica failures one row may see before it is failed (default 3)")
    add_number(sched, "--row-timeout", default=None,
               help="seconds without an answer after which a row's replica is "
                    "restarted and the row retried (default: wait)")
    add_number(sched, "--tokenizers", default=2,
               help="Ray Data actors that apply the chat template and tokenize "
                    "(default 2)")
    add_number(sched, "--tokenizer-cpus", default=0.0,
               help="CPUs reserved per tokenizer (default 0: none, they share cores "
                    "with the replicas' ranks)")
    add_number(sched, "--stream-rows", default=64,
               help="rows per batch streamed from the tokenizers to the driver "
                    "(default 64)")
    add_number(sched, "--checkpoint-rows", default=64,
               help="write a part file once this many rows finished (default 64)")
    add_number(sched, "--checkpoint-seconds", default=10.0,
               help="... or this many seconds after the oldest unwritten one (default 10)")
    add_number(sched, "--stop-after", default=None,
               help="stop after this run wrote N rows (resubmit to continue)")
    sched.add_argument("--retry-failed", action="store_true",
                       help="retry every failed row of the output (default: only the rows "
                            "that failed for a retryable reason: out of memory, a lost or "
                            "hung replica)")
    add_number(sched, "--progress-seconds", default=10.0,
               help="seconds between progress log lines (default 10)")
    bar = sched.add_mutually_exclusive_group()
    bar.add_argument("--progress-bar", dest="progress_bar", action="store_true", default=None,
                     help="show a tqdm bar (default: when stderr is a terminal)")
    bar.add_argument("--no-progress-bar", dest="progress_bar", action="store_false")


def config_from_args(args: argparse.Namespace, mode: str = "summarize") -> JobConfig:
    text, prompt = args.text_column, args.prompt_column
    if text is None and prompt is None:
        text, prompt = ("document", None) if mode == "summarize" else (None, "prompt")
    return JobConfig(
        input=args.input, output=args.output, id_column=args.id_column, text_column=text,
        prompt_column=prompt, instruction=args.instruction, model=args.model, dtype=args.dtype,
        device=args.device, tp=args.tp, replicas=args.replicas, address=args.address,
        cpus_per_rank=args.cpus_per_rank,
        strategy=strategy_options(args), max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        sampling=args.sampling,
        truncate=args.truncate, max_model_len=args.max_model_len,
        long_documents=args.long_documents or (
            None if mode == "summarize" or args.truncate else "fail"),
        chunk_tokens=args.chunk_tokens, chunk_overlap=args.chunk_overlap,
        tree_depth=args.tree_depth, tree_fan_in=args.tree_fan_in,
        chunk_instruction=args.chunk_instruction, combine_instruction=args.combine_instruction,
        baseline_fraction=args.baseline_fraction, max_inflight=args.max_inflight,
        max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory,
        memory_utilization=args.memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_attempts=args.max_attempts, row_timeout=args.row_timeout,
        checkpoint_rows=args.checkpoint_rows, checkpoint_seconds=args.checkpoint_seconds,
        stop_after=args.stop_after, retry_failed=args.retry_failed,
        progress_seconds=args.progress_seconds, tokenizers=args.tokenizers,
        tokenizer_cpus=args.tokenizer_cpus, stream_rows=args.stream_rows,
        progress_bar=args.progress_bar)
