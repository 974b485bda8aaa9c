"""What one batch job is asked to do: :class:`JobConfig` (its command line is cli/job.py)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.memory import MEMORY_UTILIZATION
from knapspec_dist.errors import UserError
from knapspec_dist.model.precision import guarantee
from knapspec_dist.option_rules import check, check_fields
from knapspec_dist.runtime.prompts import (
    CHUNK_INSTRUCTION,
    COMBINE_INSTRUCTION,
    DEFAULT_INSTRUCTION,
    TreeShape,
    check_tree_shape,
)
from knapspec_dist.speculation.options import StrategyOptions, parse_strategy

REJECTION_GUARANTEE = "plain sampling's distribution, not its tokens (--sampling rejection)"
NOT_REPRODUCIBLE = ("seeded --sampling rejection is not reproducible run to run: a token "
                    "depends on the round it fell in (which subnet drafted, how many drafts, "
                    "a kept draft or the bonus token), and the rounds depend on timing and on "
                    "the rows batched together; --sampling coupled is reproducible")
#: The numeric fields of a job, each checked by its option's rule (option_rules.py).
NUMERIC = ("tp", "replicas", "cpus_per_rank", "max_new_tokens", "temperature", "top_p", "top_k",
           "seed", "max_model_len", "baseline_fraction", "max_num_seqs", "kv_cache_memory",
           "memory_utilization", "max_num_batched_tokens", "max_inflight", "max_attempts",
           "row_timeout", "checkpoint_rows", "checkpoint_seconds", "stop_after", "stream_rows",
           "tokenizers", "tokenizer_cpus", "progress_seconds", "chunk_tokens", "chunk_overlap",
           "tree_depth", "tree_fan_in")
STRATEGY_NUMERIC = ("gamma", "tau_conf", "interval")

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
    tree_fan_in: int | None = None  # the most summaries a group combines; None: what fits
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
        if not self.input or not self.output:
            raise UserError("--input and --output are required")
        check_fields(self, NUMERIC)  # finite and in range, by the one table
        check_tree_shape(self.shape())  # the model's window: PromptBuilder, before Ray
        object.__setattr__(self, "strategy", replace(self.strategy, **{
            name: check(name, getattr(self.strategy, name)) for name in STRATEGY_NUMERIC}))
        self.generation_config()  # what the engine's configs check besides

    @property
    def mode(self) -> str:
        return "text" if self.text_column is not None else "prompt"

    @property
    def input_column(self) -> str:
        return self.text_column if self.text_column is not None else self.prompt_column

    def tree_shape(self) -> TreeShape | None:
        """How a text row past the window becomes a tree; None: it is truncated or fails."""
        return self.shape() if self.long_documents == "tree" else None

    def shape(self) -> TreeShape:
        """The tree options as a shape, whether trees are made or not (their checks)."""
        return TreeShape(self.chunk_tokens, self.chunk_overlap, self.tree_depth,
                         self.chunk_instruction, self.combine_instruction, self.tree_fan_in)

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig.of(max_new_tokens=self.max_new_tokens,
                                   temperature=self.temperature, top_k=self.top_k,
                                   top_p=self.top_p, seed=self.seed, sampling=self.sampling,
                                   max_num_batched_tokens=self.max_num_batched_tokens)

    def guarantee(self) -> str:
        """What the rows promise against plain decoding (``ar``), as summary.json's
        ``job.guarantee`` says: token-identical (fp32 on a CPU, greedy or coupled sampling),
        identical up to measured near-ties (bf16, fp16, fp32 on CUDA), or, under
        ``--sampling rejection``, plain sampling's distribution only."""
        if not self.generation_config().sampling.identical_to_plain:
            return REJECTION_GUARANTEE
        return guarantee(self.dtype, self.device)

    def reproducible(self) -> tuple[bool, str | None]:
        """Whether the same job run again writes the same texts (as far as ``guarantee``
        holds), and why not. Rejection sampling is not, even seeded: a draft is kept with a
        probability of the draft subnet's distribution, the token after the drafts is drawn
        otherwise, and which subnet drafts how many tokens depends on timing (measured
        prices, online calibration) and on the rows batched together: keying the draws by
        (seed, row, position) cannot take the rounds out of the tokens."""
        sampling = self.generation_config().sampling
        if sampling.greedy:
            return True, None
        if self.seed is None:
            return False, "sampled without --seed: every run draws its own tokens"
        if not sampling.identical_to_plain:
            return False, NOT_REPRODUCIBLE
        return True, None

    def digest(self) -> str:
        """A short hash of :meth:`fingerprint`: what a job's node table keys its nodes by."""
        text = json.dumps(self.fingerprint(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

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
            **({"long_documents": self.tree_shape().fingerprint()} if self.tree_shape() else {}),
        }

    def to_dict(self) -> dict:
        return asdict(self)
