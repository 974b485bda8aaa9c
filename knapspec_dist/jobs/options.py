"""Command-line options of the batch jobs and the :class:`JobConfig` they become."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field

from knapspec_dist.cli.common import (add_model_args, add_sampling_args, add_strategy_args,
                                      strategy_options)
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.errors import UserError
from knapspec_dist.spec.options import StrategyOptions

DEFAULT_INSTRUCTION = "Summarize the following document in a few sentences."


@dataclass(frozen=True)
class JobConfig:
    """Everything one batch job needs.  Built by :func:`config_from_args` or directly.

    ``strategy``: its options, or a strategy's name for that strategy with default options
    (turned into its :class:`StrategyOptions` on construction)."""

    input: str
    output: str
    id_column: str = "id"
    text_column: str | None = "document"  # prompt = chat template(instruction + document)
    prompt_column: str | None = None  # used as is (no template); excludes text_column
    instruction: str = DEFAULT_INSTRUCTION
    model: str = "smollm2"
    dtype: str = "fp32"
    device: str = "cpu"
    tp: int = 1
    replicas: int = 1
    address: str | None = None  # Ray address; None: the job's cluster, or a new local one
    cpus_per_rank: int = 1  # CPUs reserved per TP rank (its torch threads on CPU)
    strategy: StrategyOptions = field(default_factory=lambda: StrategyOptions(name="knapspec"))
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    truncate: bool = False
    max_model_len: int | None = None  # None: the model's context window
    baseline_fraction: float = 0.05
    max_num_seqs: int | None = None  # rows a replica decodes at once; None: memory rule
    max_inflight: int | None = None  # rows outstanding per replica; None: max_num_seqs + 2
    max_attempts: int = 3  # replica deaths one row may see before it is failed
    row_timeout: float | None = None  # seconds; a replica silent this long is restarted
    checkpoint_rows: int = 64  # flush a part file at this many finished rows ...
    checkpoint_seconds: float = 10.0  # ... or this long after the first unflushed one
    stop_after: int | None = None  # stop after this many rows were written by this run
    progress_seconds: float = 10.0
    progress_bar: bool | None = None  # None: a tqdm bar when stderr is a terminal

    def __post_init__(self):
        if isinstance(self.strategy, str):
            object.__setattr__(self, "strategy", StrategyOptions(name=self.strategy))
        if (self.text_column is None) == (self.prompt_column is None):
            raise UserError("give exactly one of --text-column and --prompt-column")
        checks = [
            (self.tp >= 1, f"--tp must be >= 1, got {self.tp}"),
            (self.replicas >= 1, f"--replicas must be >= 1, got {self.replicas}"),
            (self.cpus_per_rank >= 1, f"--cpus-per-rank must be >= 1, got {self.cpus_per_rank}"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (0 <= self.baseline_fraction <= 1,
             f"--baseline-fraction must be in [0, 1], got {self.baseline_fraction}"),
            (self.max_inflight is None or self.max_inflight >= 1,
             f"--max-inflight must be >= 1, got {self.max_inflight}"),
            (self.max_num_seqs is None or self.max_num_seqs >= 1,
             f"--max-num-seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_attempts >= 1, f"--max-attempts must be >= 1, got {self.max_attempts}"),
            (self.checkpoint_rows >= 1,
             f"--checkpoint-rows must be >= 1, got {self.checkpoint_rows}"),
            (self.checkpoint_seconds >= 0, "--checkpoint-seconds must be >= 0"),
            (self.stop_after is None or self.stop_after >= 1, "--stop-after must be >= 1"),
            (self.row_timeout is None or self.row_timeout > 0, "--row-timeout must be > 0"),
            (self.max_model_len is None or self.max_model_len >= 2, "--max-model-len must be >= 2"),
            (self.progress_seconds > 0, "--progress-seconds must be > 0"),
            (bool(self.input), "--input is required"),
            (bool(self.output), "--output is required"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        # Sampling options are validated where they are defined.
        self.generation_config()

    @property
    def mode(self) -> str:
        return "text" if self.text_column is not None else "prompt"

    @property
    def input_column(self) -> str:
        return self.text_column if self.text_column is not None else self.prompt_column

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig.of(max_new_tokens=self.max_new_tokens,
                                   temperature=self.temperature, top_k=self.top_k,
                                   top_p=self.top_p, seed=self.seed)

    def fingerprint(self) -> dict:
        """What decides a row's output: a resumed job must agree on all of it.  The runner
        adds the input's identity (path, row count, content hash: ``InputRows.fingerprint``).

        Not in it: where and how fast the job runs (tp, replicas, address, scheduling,
        checkpointing, --stop-after) and the baseline share.
        """
        return {
            "id_column": self.id_column,
            "mode": self.mode,
            "input_column": self.input_column,
            "instruction": self.instruction if self.mode == "text" else None,
            "model": self.model,
            "dtype": self.dtype,
            "strategy": self.strategy.name,
            "strategy_options": dict(sorted((k, v) for k, v in asdict(self.strategy).items()
                                            if k != "name")),
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "truncate": self.truncate,
            "max_model_len": self.max_model_len,
        }

    def to_dict(self) -> dict:
        return asdict(self)


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
                        help=f"instruction before the document (default: {DEFAULT_INSTRUCTION!r})")
    else:
        src.add_argument("--prompt-column", default=None,
                         help="prompt column, used as is (default: prompt)")
        src.add_argument("--text-column", default=None,
                         help="message column: wrapped as a user message in the chat template")
        io.add_argument("--instruction", default="",
                        help="text put before each --text-column message (default: none)")
    add_model_args(p)
    run = p.add_argument_group("cluster")
    run.add_argument("--tp", type=int, default=1, help="tensor-parallel degree per replica")
    run.add_argument("--replicas", type=int, default=1, help="model replicas (TP groups)")
    run.add_argument("--address", default=None,
                     help="Ray address (default: the job's cluster, else a new local Ray)")
    run.add_argument("--cpus-per-rank", type=int, default=1,
                     help="CPUs reserved per tensor-parallel rank; on CPU also its torch "
                          "threads (default 1)")
    add_strategy_args(p)
    add_sampling_args(p)
    rows = p.add_argument_group("rows")
    rows.add_argument("--truncate", action="store_true",
                      help="cut over-long documents to fit the context window (the end of the "
                           "document, or of a --prompt-column prompt, is dropped) instead of "
                           "failing the row")
    rows.add_argument("--max-model-len", type=int, default=None,
                      help="context window to allow per row (prompt + new tokens); default and "
                           "maximum: the model's")
    rows.add_argument("--baseline-fraction", type=float, default=0.05,
                      help="share of rows run again, with the job's strategy and with `ar`, "
                           "to measure the speedup (at least one row; 0 turns the baseline "
                           "off; default 0.05)")
    sched = p.add_argument_group("scheduling and checkpoints")
    sched.add_argument("--max-num-seqs", type=int, default=None,
                       help="rows each replica decodes at once, continuously batched (default: "
                            "what the memory left after the weights holds, at most 256 on a "
                            "GPU and 16 on a CPU)")
    sched.add_argument("--max-inflight", type=int, default=None,
                       help="rows outstanding per replica (default: max-num-seqs + 2, so a "
                            "freed slot is refilled at once)")
    sched.add_argument("--max-attempts", type=int, default=3,
                       help="replica failures one row may see before it is failed (default 3)")
    sched.add_argument("--row-timeout", type=float, default=None,
                       help="seconds without an answer after which a row's replica is "
                            "restarted and the row retried (default: wait)")
    sched.add_argument("--checkpoint-rows", type=int, default=64,
                       help="write a part file once this many rows finished (default 64)")
    sched.add_argument("--checkpoint-seconds", type=float, default=10.0,
                       help="... or this many seconds after the oldest unwritten one (default 10)")
    sched.add_argument("--stop-after", type=int, default=None,
                       help="stop after this run wrote N rows (resubmit to continue)")
    sched.add_argument("--progress-seconds", type=float, default=10.0,
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
        truncate=args.truncate, max_model_len=args.max_model_len,
        baseline_fraction=args.baseline_fraction, max_inflight=args.max_inflight,
        max_num_seqs=args.max_num_seqs,
        max_attempts=args.max_attempts, row_timeout=args.row_timeout,
        checkpoint_rows=args.checkpoint_rows, checkpoint_seconds=args.checkpoint_seconds,
        stop_after=args.stop_after, progress_seconds=args.progress_seconds,
        progress_bar=args.progress_bar)
