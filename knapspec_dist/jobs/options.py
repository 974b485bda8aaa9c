"""What one batch job is asked to do: :class:`JobConfig` (its command line is cli/job.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.memory import MEMORY_UTILIZATION, check_utilization, kv_memory_option
from knapspec_dist.errors import UserError
from knapspec_dist.runtime.prompts import (
    CHUNK_INSTRUCTION,
    COMBINE_INSTRUCTION,
    DEFAULT_INSTRUCTION,
    TreeShape,
)
from knapspec_dist.speculation.options import StrategyOptions, parse_strategy


@dataclass(frozen=True)
class JobConfig:
    """Everything one batch job needs.  Built by ``cli.job.config_from_args`` or directly.

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
    cpus_per_rank: int | None = None  # CPUs per TP rank (its torch threads on CPU); None:
    # the cluster's cores shared by the ranks
    strategy: StrategyOptions = field(default_factory=lambda: StrategyOptions(name="knapspec"))
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    sampling: str = "coupled"  # how sampled drafts are verified (SamplingConfig.method)
    truncate: bool = False
    # a text row past the window: "tree" (its chunks summarized, then their summaries), or
    # "truncate" / "fail" (prompt mode: as --truncate says); None: "tree" in text mode
    long_documents: str | None = None
    chunk_tokens: int | None = None  # a chunk's document tokens; None: from the window
    chunk_overlap: int = 0  # tokens of the previous chunk repeated at a chunk's start
    tree_depth: int = 8  # the most levels of a tree, its chunks' included
    chunk_instruction: str = CHUNK_INSTRUCTION
    combine_instruction: str = COMBINE_INSTRUCTION
    max_model_len: int | None = None  # None: the model's context window
    baseline_fraction: float = 0.05
    max_num_seqs: int | None = None  # cap on a replica's rows in flight; None: 256 GPU, 16 CPU
    kv_cache_memory: int | str | None = None  # KV bytes per rank ("2GiB"); None: utilization
    memory_utilization: float = MEMORY_UTILIZATION  # of the memory free after the weights
    # prompt tokens a replica's step prefills; None: the device's (engine/scheduler.py)
    max_num_batched_tokens: int | None = None
    max_inflight: int | None = None  # rows outstanding per replica; None: max_num_seqs + 2
    max_attempts: int = 3  # replica deaths one row may see before it is failed
    row_timeout: float | None = None  # seconds; a replica silent this long is restarted
    checkpoint_rows: int = 64  # flush a part file at this many finished rows ...
    checkpoint_seconds: float = 10.0  # ... or this long after the first unflushed one
    stop_after: int | None = None  # stop after this many rows were written by this run
    retry_failed: bool = False  # retry every failed row (default: the retryable kinds only)
    stream_rows: int = 64  # rows per batch streamed from the tokenize stage to the driver
    tokenizers: int = 2  # Ray Data actors that tokenize (each loads the tokenizer once)
    # CPUs reserved per tokenizer; 0: none, it shares cores with the ranks (a CPU engine may
    # reserve every CPU of a machine, and a stage that waits for a CPU would never start)
    tokenizer_cpus: float = 0.0
    progress_seconds: float = 10.0
    progress_bar: bool | None = None  # None: a tqdm bar when stderr is a terminal

    def __post_init__(self):
        if isinstance(self.strategy, str):
            name = self.strategy  # a bare name, or one with flags as the command line takes it
            options = (parse_strategy(name).options if ":" in name or "@" in name
                       else StrategyOptions(name=name))
            object.__setattr__(self, "strategy", options)
        if (self.text_column is None) == (self.prompt_column is None):
            raise UserError("give exactly one of --text-column and --prompt-column")
        if self.long_documents not in (None, "tree", "truncate", "fail"):
            raise UserError(f"--long-documents must be tree, truncate or fail, got "
                            f"{self.long_documents!r}")
        if self.long_documents == "tree" and self.mode == "prompt":
            raise UserError("--long-documents tree needs --text-column: a ready-made prompt "
                            "cannot be cut into chunks")
        if self.truncate and self.long_documents not in (None, "truncate"):
            raise UserError(f"--truncate contradicts --long-documents {self.long_documents}")
        if self.long_documents is None:
            object.__setattr__(self, "long_documents", "truncate" if self.truncate else
                               "tree" if self.mode == "text" else "fail")
        object.__setattr__(self, "truncate", self.long_documents == "truncate")
        checks = [
            (self.tp >= 1, f"--tp must be >= 1, got {self.tp}"),
            (self.replicas >= 1, f"--replicas must be >= 1, got {self.replicas}"),
            (self.cpus_per_rank is None or self.cpus_per_rank >= 1,
             f"--cpus-per-rank must be >= 1, got {self.cpus_per_rank}"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (0 <= self.baseline_fraction <= 1,
             f"--baseline-fraction must be in [0, 1], got {self.baseline_fraction}"),
            (self.max_inflight is None or self.max_inflight >= 1,
             f"--max-inflight must be >= 1, got {self.max_inflight}"),
            (self.max_num_seqs is None or self.max_num_seqs >= 1,
             f"--max-num-seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"),
            (self.max_attempts >= 1, f"--max-attempts must be >= 1, got {self.max_attempts}"),
            (self.checkpoint_rows >= 1,
             f"--checkpoint-rows must be >= 1, got {self.checkpoint_rows}"),
            (self.checkpoint_seconds >= 0, "--checkpoint-seconds must be >= 0"),
            (self.stop_after is None or self.stop_after >= 1, "--stop-after must be >= 1"),
            (self.row_timeout is None or self.row_timeout > 0, "--row-timeout must be > 0"),
            (self.max_model_len is None or self.max_model_len >= 2, "--max-model-len must be >= 2"),
            (self.chunk_tokens is None or self.chunk_tokens >= 1,
             f"--chunk-tokens must be >= 1, got {self.chunk_tokens}"),
            (self.chunk_overlap >= 0, f"--chunk-overlap must be >= 0, got {self.chunk_overlap}"),
            (self.chunk_tokens is None or self.chunk_overlap < self.chunk_tokens,
             "--chunk-overlap must be less than --chunk-tokens"),
            (self.tree_depth >= 2, f"--tree-depth must be >= 2, got {self.tree_depth}"),
            (self.progress_seconds > 0, "--progress-seconds must be > 0"),
            (self.stream_rows >= 1, f"--stream-rows must be >= 1, got {self.stream_rows}"),
            (self.tokenizers >= 1, f"--tokenizers must be >= 1, got {self.tokenizers}"),
            (self.tokenizer_cpus >= 0, "--tokenizer-cpus must be >= 0"),
            (bool(self.input), "--input is required"),
            (bool(self.output), "--output is required"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        # Sampling and memory options are validated where they are defined.
        self.generation_config()
        object.__setattr__(self, "kv_cache_memory", kv_memory_option(self.kv_cache_memory))
        check_utilization(self.memory_utilization)

    @property
    def mode(self) -> str:
        return "text" if self.text_column is not None else "prompt"

    @property
    def input_column(self) -> str:
        return self.text_column if self.text_column is not None else self.prompt_column

    def tree_shape(self) -> TreeShape | None:
        """How a text row past the window becomes a tree; None: it is truncated or fails."""
        if self.long_documents != "tree":
            return None
        return TreeShape(self.chunk_tokens, self.chunk_overlap, self.tree_depth,
                         self.chunk_instruction, self.combine_instruction)

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig.of(max_new_tokens=self.max_new_tokens,
                                   temperature=self.temperature, top_k=self.top_k,
                                   top_p=self.top_p, seed=self.seed, sampling=self.sampling,
                                   max_num_batched_tokens=self.max_num_batched_tokens)

    def fingerprint(self) -> dict:
        """What decides a row's output: a resumed job must agree on all of it.  The runner
        adds the input's identity (path, row count, footer hash: ``InputScan.fingerprint``).

        Not in it: where and how fast the job runs (tp, replicas, address, scheduling, the
        KV cache's size, tokenizers, checkpointing, --stop-after, --retry-failed) and the
        baseline share.
        """
        return {
            "id_column": self.id_column,
            "mode": self.mode,
            "input_column": self.input_column,
            "instruction": self.instruction if self.mode == "text" else None,
            "model": self.model,
            "dtype": self.dtype,
            "strategy": self.strategy.name,
            # calibration only prices the rounds: the tokens are the same either way
            "strategy_options": dict(sorted((k, v) for k, v in asdict(self.strategy).items()
                                            if k not in ("name", "calibrate"))),
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            # rejection sampling's tokens differ from coupled ones; absent for coupled, as
            # before the option existed, so that earlier outputs resume
            **({"sampling": self.sampling} if self.sampling != "coupled" else {}),
            "truncate": self.truncate,
            "max_model_len": self.max_model_len,
            # absent unless trees are made, as before they were, so that earlier outputs
            # resume (with --long-documents fail: a tree changes what a long row gets)
            **({"long_documents": asdict(self.tree_shape())} if self.tree_shape() else {}),
        }

    def to_dict(self) -> dict:
        return asdict(self)
