"""A Ray Data processor for Python drivers: any Dataset in, ``generated_text`` and our per-row
statistics out, the way ``ray.data.llm``'s processors work.

>>> import ray
>>> from knapspec_dist.runtime.processor import ProcessorConfig, build_processor
>>> processor = build_processor(
...     ProcessorConfig(model="smollm2", strategy="knapspec", concurrency=2,
...                     sampling={"max_new_tokens": 64}),
...     preprocess=lambda row: {"messages": [{"role": "user", "content": row["text"]}]},
...     postprocess=lambda row: {"summary": row["generated_text"], **row})
>>> out = processor(ray.data.read_parquet("/data/docs"))   # lazy, like any Dataset

Stages, as in ``ray.data.llm`` and described once in runtime/stages.py: ``preprocess`` (a
``map`` of the user's), chat template and tokenize (runtime/prompts.py's TokenizeStage, the
batch job's own: ``messages`` through the template, or ``prompt`` as is; CPU actors; a
prompt too long for the model's window is that row's error), the engine (one Ray Data actor
per replica, each owning one TP group: its placement group, coordinator and shard actors,
i.e. a one-replica :class:`~knapspec_dist.runtime.ray_engine.RayEngine`, fed by the batch job's
Dispatcher: a dead replica is restarted and its rows retried; the coordinator detokenizes),
``postprocess``. The rows of a batch decode together in the replica's continuous batch
(``batch_size``, 2 x ``max_num_seqs`` by default, keeps it full).

With a ``document_column`` a row is a document to summarize (the batch job's text mode: the
chat template around ``instruction`` and the document); one past the window is summarized
through a tree of chunk summaries (``long_documents="tree"``, the default there:
runtime/tree_tasks.py, shaped by ``tree``), or ``"truncate"``d, or fails (``"fail"``); the
row says which (``document_path``) and how big its tree was (``tree_*``). Unlike the job's, a
tree is not kept node by node: a Dataset has no resume.

On a CPU each rank runs torch threads on its share of the cluster's cores (as the job's
ranks do) unless ``cpus_per_rank`` says how many; Ray reserves the ranks all CPUs but one,
which the Dataset's own read and ``map`` tasks need to run (``with_cores``).

With ``should_continue_on_error`` a row that fails gets its ``error`` (and ``error_kind``)
and the others go on; without it the first failure fails the Dataset, as in ``ray.data.llm``.

What the batch job (jobs/) adds around the same stages: resume, exactly-once part files, the
baseline passes with the measured speedup, retries across replicas, the summary.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field, replace
from typing import Callable

import pyarrow as pa
import ray

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.memory import MEMORY_UTILIZATION
from knapspec_dist.errors import UserError
from knapspec_dist.option_rules import check, check_fields
from knapspec_dist.runtime.backend import EngineBackend
from knapspec_dist.runtime.dispatch import Dispatcher, Outcome
from knapspec_dist.runtime.prompts import (
    CHUNK_COLUMNS,
    DEFAULT_INSTRUCTION,
    PromptBuilder,
    TokenizeStage,
    TreeShape,
    check_tree_shape,
    load_text_tools,
    make_builder,
)
from knapspec_dist.runtime.ray_engine import RayEngine
from knapspec_dist.runtime.replica import node_cpus, share_cores
from knapspec_dist.runtime.stages import (
    RESULT_FIELDS,
    TREE_FIELDS,
    Stage,
    batch_tasks,
    outcome_columns,
)
from knapspec_dist.runtime.tree import DocumentTree
from knapspec_dist.runtime.tree_tasks import NodeTask, TreeDispatch, TreeTask, tree_row
from knapspec_dist.speculation.options import StrategyOptions

log = logging.getLogger(__name__)

#: ``ProcessorConfig.sampling``'s keys: GenerationConfig.of's fields but the prefill budget
#: (``max_num_batched_tokens``, an option of its own).
SAMPLING_KEYS = tuple(k for k in inspect.signature(GenerationConfig.of).parameters
                      if k != "max_num_batched_tokens")

__all__ = ["ProcessorConfig", "build_processor", "stages"]


@dataclass(frozen=True)
class ProcessorConfig:
    """One processor: the model, how many replicas (``concurrency``: a number, or a
    ``(min, max)`` range Ray Data scales within), the strategy and its options, the
    batching (``max_num_seqs``, ``max_num_batched_tokens``), the KV cache (docs/batching.md)
    and the sampling (GenerationConfig.of's fields: max_new_tokens, temperature, top_k, top_p,
    seed, sampling)."""

    model: str = "smollm2"
    tp: int = 1
    concurrency: int | tuple[int, int] = 1
    strategy: StrategyOptions | str = "knapspec"
    dtype: str = "fp32"
    device: str = "cpu"
    cpus_per_rank: int | None = None  # None: the cluster's cores shared by the ranks
    max_num_seqs: int | None = None  # cap on rows in flight; None: 256 on a GPU, 16 on a CPU
    kv_cache_memory: int | str | None = None  # KV bytes per rank ("2GiB"); None: utilization
    memory_utilization: float = MEMORY_UTILIZATION  # of the memory free after the weights
    max_model_len: int | None = None  # the longest row the KV cache must hold; None: window
    max_num_batched_tokens: int | None = None  # prompt tokens a step prefills; None: device's
    batch_size: int | None = None  # rows per engine call; None: 2 x max_num_seqs, else 16
    sampling: dict = field(default_factory=dict)
    should_continue_on_error: bool = False
    max_attempts: int = 3  # replica failures a row may see before it fails (dispatch.py)
    apply_chat_template: bool = True  # ``messages`` through the template; else ``prompt``
    document_column: str | None = None  # a document to summarize (over the two above)
    instruction: str = DEFAULT_INSTRUCTION  # before the document (``{document}``: around it)
    long_documents: str | None = None  # tree | truncate | fail; None: tree for documents
    tree: TreeShape = field(default_factory=TreeShape)
    tokenizer_concurrency: int = 1
    tokenizer_cpus: float = 0.0  # 0: shares cores with the ranks (see runtime/stream.py)

    def __post_init__(self):
        if isinstance(self.strategy, str):
            object.__setattr__(self, "strategy", StrategyOptions(name=self.strategy))
        if self.long_documents is None:
            object.__setattr__(self, "long_documents",
                               "tree" if self.document_column is not None else "fail")
        if self.long_documents not in ("tree", "truncate", "fail") or (
                self.long_documents == "tree" and self.document_column is None):
            raise UserError(f"long_documents {self.long_documents!r}: one of tree (with a "
                            "document_column), truncate or fail")
        pool = self.concurrency  # a number of replicas, or a (min, max) range
        if isinstance(pool, tuple) and len(pool) == 2:
            low, high = (check("concurrency", n) for n in pool)
            if low > high:
                raise UserError(f"concurrency {pool!r}: min must be <= max")
            object.__setattr__(self, "concurrency", (low, high))
        else:
            check_fields(self, ("concurrency",))
        check_fields(self, ("tp", "cpus_per_rank", "max_num_seqs", "kv_cache_memory",
                            "memory_utilization", "max_model_len", "max_num_batched_tokens",
                            "batch_size", "max_attempts", "tokenizer_concurrency",
                            "tokenizer_cpus"))
        unknown = sorted(set(self.sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise UserError(f"sampling: unknown key(s) {', '.join(map(repr, unknown))}; "
                            f"expected some of {', '.join(SAMPLING_KEYS)}")
        check("max_new_tokens", self.sampling.get("max_new_tokens"))
        for name, value in (("chunk_tokens", self.tree.chunk_tokens),
                            ("chunk_overlap", self.tree.overlap),
                            ("tree_depth", self.tree.max_depth),
                            ("tree_fan_in", self.tree.max_fan_in)):
            check(name, value)
        check_tree_shape(self.tree)  # the model's window: when the processor is built
        self.generation_config()  # bad sampling options fail here, not in a worker

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig.of(**self.sampling,
                                   max_num_batched_tokens=self.max_num_batched_tokens)

    @property
    def column(self) -> str:
        """The column the tokenize stage reads."""
        return self.document_column or ("messages" if self.apply_chat_template else "prompt")

    def builder(self) -> Callable[[], PromptBuilder]:
        """The tokenize stage's PromptBuilder, made where it runs (it loads the tokenizer)."""
        mode = ("text" if self.document_column else
                "messages" if self.apply_chat_template else "prompt")
        return functools.partial(
            make_builder, load_text_tools, self, mode,
            self.instruction if self.document_column else "", self.max_model_len,
            self.generation_config().max_new_tokens, self.long_documents == "truncate",
            self.column, self.tree if self.long_documents == "tree" else None)

    def rows_per_call(self) -> int:
        return self.batch_size or (2 * self.max_num_seqs if self.max_num_seqs else 16)


class EngineStage:
    """One replica (a one-replica RayEngine: its TP group) as a Ray Data actor, fed by the
    Dispatcher: every row of a batch is submitted at once, so they share the replica's
    continuous batch, and a replica failure restarts it and retries its rows."""

    def __init__(self, config: ProcessorConfig, reserved_cpus: float | None = None):
        c = config
        self.config = c
        self.engine = RayEngine(c.model, tp=c.tp, replicas=1, strategy=c.strategy, dtype=c.dtype,
                             device=c.device, cpus_per_rank=c.cpus_per_rank,
                             reserved_cpus_per_rank=reserved_cpus,
                             max_num_seqs=c.max_num_seqs, max_model_len=c.max_model_len,
                             kv_cache_memory=c.kv_cache_memory,
                             memory_utilization=c.memory_utilization)
        self.dispatcher = Dispatcher(EngineBackend(self.engine), c.generation_config(),
                                     max_inflight=c.rows_per_call(),
                                     max_attempts=c.max_attempts)
        self.trees = (TreeDispatch(c.builder()(), self.dispatcher)
                      if c.long_documents == "tree" else None)
        self.fields = RESULT_FIELDS + (TREE_FIELDS if c.document_column else [])

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows: list[dict] = [{} for _ in range(batch.num_rows)]
        chunks = (batch.column("chunk_prompts").to_pylist()
                  if "chunk_prompts" in batch.column_names else None)
        tasks = []
        for i, task in batch_tasks(batch, list(range(batch.num_rows))):
            if task is None:  # the tokenize stage's error: the row's input
                rows[i] = {"error": batch.column("error")[i].as_py(), "error_kind": "input",
                           "num_input_tokens": batch.column("num_input_tokens")[i].as_py()}
                self._check(rows[i])
            elif chunks is not None and chunks[i] is not None:
                digests = batch.column("chunk_digests")[i].as_py()
                tasks.append(TreeTask(i, (), chunks=list(zip(chunks[i], digests))))
            else:
                tasks.append(task)
        paths = ["truncated" if t else "whole" for t in batch.column("truncated").to_pylist()]

        def on_tree(tree: DocumentTree, task) -> None:
            result, columns = tree_row(tree)
            rows[tree.key] = self._check({
                **outcome_columns(Outcome(task, result=result, error=tree.error,
                                          kind=tree.error_kind)), **columns,
                "num_input_tokens": batch.column("num_input_tokens")[tree.key].as_py()})

        def on_result(outcome: Outcome) -> None:
            if isinstance(outcome.task, NodeTask):
                tree = self.trees.landed(outcome)
                if tree is not None:
                    on_tree(tree, outcome.task)
                return
            rows[outcome.task.key] = self._check(
                {**outcome_columns(outcome), "document_path": paths[outcome.task.key]})

        todo = tasks if self.trees is None else self.trees.expand(iter(tasks), on_tree)
        self.dispatcher.run(todo, on_result, lookahead=0)
        out = pa.Table.from_pylist(rows, schema=pa.schema(self.fields))
        keep = batch.drop_columns([n for n in batch.column_names if n in out.column_names
                                   or n in ("prompt_ids", *CHUNK_COLUMNS)])
        for name in out.column_names:
            keep = keep.append_column(name, out.column(name))
        return keep

    def _check(self, row: dict) -> dict:
        if row.get("error") is not None and not self.config.should_continue_on_error:
            raise UserError(f"a row failed ({row['error']}); pass should_continue_on_error="
                            "True to write it as that row's error and go on")
        return row

    def __del__(self):
        """Stop the replica and hand its placement group (the driver's job owns it: it would
        hold its CPUs until the driver exits) back when Ray Data's graceful shutdown drops
        the stage. Nothing here is in a reference cycle (the dispatcher keeps no callback
        past its run), or the stage would only be collected after Ray disconnected, where a
        Ray call starts a second core worker and aborts the process."""
        engine = getattr(self, "engine", None)
        if engine is not None and ray.is_initialized():
            engine.shutdown()


#: CPUs the processor's ranks leave to the Dataset's own tasks: a user's ``read_parquet`` or
#: ``map`` reserves one each, and with every CPU held by the ranks it would never run.
DATASET_CPUS = 1
MIN_RESERVED = 0.01


def with_cores(config: ProcessorConfig) -> tuple[ProcessorConfig, float | None]:
    """``config`` with its CPUs per rank decided, once for every replica (each EngineStage
    deciding for itself would race: the first to start would take every free CPU), and what
    Ray reserves per rank (None: as many). Unless ``cpus_per_rank`` is given, on a CPU each
    rank runs threads on its share of the cluster's cores (replica.share_cores, RayEngine's
    rule, over ``tp`` x the most replicas, less the tokenize stage's CPUs) but reserves its
    share of all but ``DATASET_CPUS`` of them (at least ``MIN_RESERVED``: Ray refuses an empty
    bundle). All the cluster's CPUs, not those free now: an earlier processor's replicas
    still held by Ray Data's idle actors are released, and the new ones wait for them. Needs
    Ray up."""
    if config.cpus_per_rank is not None or config.device == "cuda":
        return replace(config, cpus_per_rank=config.cpus_per_rank or 1), None
    pool = config.concurrency
    replicas = pool[1] if isinstance(pool, tuple) else pool
    ranks = config.tp * replicas
    nodes = node_cpus()
    cpus = sum(nodes) - config.tokenizer_cpus * config.tokenizer_concurrency
    threads = share_cores(nodes, int(cpus), config.tp, replicas)
    reserved = max(MIN_RESERVED, min(float(threads), (cpus - DATASET_CPUS) / ranks))
    log.info("%d thread(s) per rank, %.2g CPU(s) reserved (the cluster's %g CPUs shared by %d "
             "rank(s), %d left to the Dataset's tasks; cpus_per_rank sets both)", threads,
             reserved, sum(nodes), ranks, DATASET_CPUS)
    return replace(config, cpus_per_rank=threads), reserved


def stages(config: ProcessorConfig) -> list[Stage]:
    """The processor's tokenize and engine stages (runtime/stages.py), with the CPUs per rank
    decided (``with_cores``: Ray must be up)."""
    config, reserved = with_cores(config)
    # The engine actor holds no CPU itself: its shard actors reserve the replica's CPUs/GPUs.
    return [Stage(TokenizeStage, (config.builder(), config.column), rows=16,
                  actors=config.tokenizer_concurrency, cpus=config.tokenizer_cpus),
            Stage(EngineStage, (config, reserved), rows=config.rows_per_call(),
                  actors=config.concurrency, cpus=0)]


def build_processor(config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None
                    ) -> Callable[[ray.data.Dataset], ray.data.Dataset]:
    """A function from a Dataset to the Dataset of its generations (lazy: nothing runs
    before the result is consumed). The model, tp and strategy are checked here, at once,
    and the prompt options against the model's tokenizer and window (a tree's shape no long
    document could take: runtime/prompts.py ``tree_chunk_tokens``), as the batch job does
    before its Ray starts."""
    config.builder()()  # check_setup, then the PromptBuilder's checks

    def processor(ds: ray.data.Dataset) -> ray.data.Dataset:
        if not ray.is_initialized():  # as the Dataset's execution would
            ray.init()
        if preprocess is not None:
            ds = ds.map(preprocess)
        for stage in stages(config):  # Ray is up: the CPUs per rank can be decided
            ds = stage.on(ds)
        if postprocess is not None:
            ds = ds.map(postprocess)
        return ds

    return processor
