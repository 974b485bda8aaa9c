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

Stages, as in ``ray.data.llm``: ``preprocess`` (a ``map`` of the user's), chat template
and tokenize (``messages`` with the template, or ``prompt`` as is; CPU actors), the engine
(one Ray Data actor per replica, each owning one TP group: its placement group, coordinator
and shard actors, i.e. a one-replica :class:`~knapspec_dist.runtime.engine.Engine`; the
coordinator detokenizes), ``postprocess``. The rows of a batch decode together in the
replica's continuous batch (``batch_size``, 2 x ``max_num_seqs`` by default, keeps it full).

With ``should_continue_on_error`` a row whose generation fails gets its ``error`` and the
others go on; without it the first failure fails the Dataset, as in ``ray.data.llm``.

What the batch job (jobs/) adds and this does not: resume, exactly-once part files, the
baseline passes with the measured speedup, and retries after a replica dies.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import asdict, dataclass, field
from typing import Callable

import pyarrow as pa
import ray

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.model.embedded import resolve_model_path
from knapspec_dist.model.tokenizer import load_tokenizer
from knapspec_dist.runtime.backend import describe_error
from knapspec_dist.runtime.engine import Engine
from knapspec_dist.runtime.setup import check_setup
from knapspec_dist.spec.options import StrategyOptions

log = logging.getLogger(__name__)

__all__ = ["ProcessorConfig", "build_processor", "result_columns"]


def _utc(epoch: float) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc) if epoch else None


def result_columns(result) -> dict:
    """A GenerationResult as output columns (``ray.data.llm``'s names where they overlap):
    the one mapping of our per-row statistics, shared with the batch job's rows."""
    s = result.stats
    return {"generated_text": result.text, "generated_tokens": list(result.token_ids),
            "num_input_tokens": s.prompt_tokens, "num_generated_tokens": s.new_tokens,
            "finish_reason": result.finish_reason, "time_taken_llm": s.wall_s,
            "prefill_s": s.prefill_s, "tokens_per_s": s.tokens_per_s, "steps": s.steps,
            "drafted": s.drafted, "accepted": s.accepted, "acceptance_rate": s.acceptance_rate,
            "attention_skipped": s.attention_skipped, "mlp_skipped": s.mlp_skipped,
            "selections": s.selections, "mean_batch": s.mean_batch,
            "plans": [{"plan": label, **asdict(t)} for label, t in s.plans.items()],
            "generation_start": _utc(s.admitted_at), "generation_end": _utc(s.finished_at)}


#: Per plan a row decoded with: its rounds, tokens, seconds, and the predicted tokens over the
#: seconds priced (engine/generation.py ``PlanTally``); jobs/summary.py sums them per plan.
PLANS = pa.list_(pa.struct([("plan", pa.string()), ("rounds", pa.int64()),
                            ("tokens", pa.int64()), ("seconds", pa.float64()),
                            ("predicted_tokens", pa.float64()), ("priced_s", pa.float64())]))


#: Columns the engine stage adds to every row (null where the row failed), and ``error``.
RESULT_FIELDS = [
    ("generated_text", pa.string()), ("generated_tokens", pa.list_(pa.int32())),
    ("num_input_tokens", pa.int64()), ("num_generated_tokens", pa.int64()),
    ("finish_reason", pa.string()), ("time_taken_llm", pa.float64()),
    ("prefill_s", pa.float64()), ("tokens_per_s", pa.float64()), ("steps", pa.int64()),
    ("drafted", pa.int64()), ("accepted", pa.int64()), ("acceptance_rate", pa.float64()),
    ("attention_skipped", pa.float64()), ("mlp_skipped", pa.float64()),
    ("selections", pa.int64()), ("mean_batch", pa.float64()), ("plans", PLANS),
    ("generation_start", pa.timestamp("us", tz="UTC")),
    ("generation_end", pa.timestamp("us", tz="UTC")), ("error", pa.string())]


@dataclass(frozen=True)
class ProcessorConfig:
    """One processor: the model, how many replicas (``concurrency``: a number, or a
    ``(min, max)`` range Ray Data scales within), the strategy and its options, the
    batching and the sampling (GenerationConfig.of's fields: max_new_tokens, temperature,
    top_k, top_p, seed)."""

    model: str = "smollm2"
    tp: int = 1
    concurrency: int | tuple[int, int] = 1
    strategy: StrategyOptions | str = "knapspec"
    dtype: str = "fp32"
    device: str = "cpu"
    cpus_per_rank: int = 1
    max_num_seqs: int | None = None
    batch_size: int | None = None  # rows per engine call; None: 2 x max_num_seqs, else 16
    sampling: dict = field(default_factory=dict)
    should_continue_on_error: bool = False
    apply_chat_template: bool = True  # ``messages`` through the template; else ``prompt``
    tokenizer_concurrency: int = 1
    tokenizer_cpus: float = 0.0  # 0: shares cores with the ranks (see runtime/stream.py)

    def __post_init__(self):
        if isinstance(self.strategy, str):
            object.__setattr__(self, "strategy", StrategyOptions(name=self.strategy))
        self.generation_config()  # bad sampling options fail here, not in a worker

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig.of(**self.sampling)

    def rows_per_call(self) -> int:
        return self.batch_size or (2 * self.max_num_seqs if self.max_num_seqs else 16)


class ChatTemplateTokenize:
    """``messages`` (or ``prompt``) to ``prompt_ids``; the tokenizer loaded once per actor."""

    def __init__(self, model: str, chat: bool):
        self.tokenizer, self.chat = load_tokenizer(resolve_model_path(model)), chat

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.chat:
            ids = [list(_ids(self.tokenizer.apply_chat_template(
                m, add_generation_prompt=True, tokenize=True)))
                for m in batch.column("messages").to_pylist()]
        else:
            ids = [self.tokenizer(p, add_special_tokens=True)["input_ids"]
                   for p in batch.column("prompt").to_pylist()]
        return batch.append_column("prompt_ids", pa.array(ids, pa.list_(pa.int32())))


def _ids(encoded):
    return encoded["input_ids"] if hasattr(encoded, "keys") else encoded


class EngineStage:
    """One replica (a one-replica Engine: its TP group) as a Ray Data actor; every row of a
    batch is submitted at once, so they share the replica's continuous batch."""

    def __init__(self, config: ProcessorConfig):
        c = config
        self.config, self.generation = c, c.generation_config()
        self.engine = Engine(c.model, tp=c.tp, replicas=1, strategy=c.strategy, dtype=c.dtype,
                             device=c.device, cpus_per_rank=c.cpus_per_rank,
                             max_num_seqs=c.max_num_seqs)

    def __call__(self, batch: pa.Table) -> pa.Table:
        prompts = batch.column("prompt_ids").to_pylist()
        refs = [self.engine.submit(0, ids, self.generation) for ids in prompts]
        rows = []
        for ref in refs:
            try:
                rows.append({**result_columns(ray.get(ref)), "error": None})
            except Exception as e:  # noqa: BLE001 - a row's failure, by the config's rule
                if not self.config.should_continue_on_error:
                    raise
                rows.append({"error": describe_error(e)})
        out = pa.Table.from_pylist(rows, schema=pa.schema(RESULT_FIELDS))
        keep = batch.drop_columns([n for n in out.column_names if n in batch.column_names]
                                  + ["prompt_ids"])
        for name in out.column_names:
            keep = keep.append_column(name, out.column(name))
        return keep

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def build_processor(config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None
                    ) -> Callable[[ray.data.Dataset], ray.data.Dataset]:
    """A function from a Dataset to the Dataset of its generations (lazy: nothing runs
    before the result is consumed). The model, tp and strategy are checked here, at once."""
    check_setup(config.model, config.tp, config.strategy)

    def processor(ds: ray.data.Dataset) -> ray.data.Dataset:
        if preprocess is not None:
            ds = ds.map(preprocess)
        ds = ds.map_batches(ChatTemplateTokenize, fn_constructor_args=(
            config.model, config.apply_chat_template), batch_format="pyarrow", batch_size=16,
            compute=ray.data.ActorPoolStrategy(size=config.tokenizer_concurrency),
            num_cpus=config.tokenizer_cpus)
        replicas = config.concurrency
        pool = (ray.data.ActorPoolStrategy(min_size=replicas[0], max_size=replicas[1])
                if isinstance(replicas, tuple) else ray.data.ActorPoolStrategy(size=replicas))
        # The actor holds no CPU itself: its shard actors reserve the replica's CPUs/GPUs.
        ds = ds.map_batches(EngineStage, fn_constructor_args=(config,), batch_format="pyarrow",
                            batch_size=config.rows_per_call(), compute=pool, num_cpus=0)
        if postprocess is not None:
            ds = ds.map(postprocess)
        return ds

    return processor
