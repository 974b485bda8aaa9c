"""Can this model run ``tp`` ways with this strategy, in this KV budget? Answered from small
files only.

The one check before anything costly: the batch job calls it before it tokenizes a single
row, the engine before it starts an actor. A bad ``--model``, a tp degree the heads do not
divide, a bad strategy option or unreadable weights then fail in seconds, with one line.
"""

from __future__ import annotations

from pathlib import Path

from knapspec_dist.engine.memory import KVBudget, kv_bytes_per_token_of, kv_source, plan_kv
from knapspec_dist.engine.pages import page_size
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.errors import UserError
from knapspec_dist.model.attention import default_backend
from knapspec_dist.model.config import ModelConfig, load_config
from knapspec_dist.model.embedded import resolve_model_path
from knapspec_dist.model.weights import checkpoint_files, resolve_dtype
from knapspec_dist.parallel import check_shardable
from knapspec_dist.runtime.messages import ReplicaBudget
from knapspec_dist.speculation.options import StrategyOptions, check_options


def check_setup(model: str, tp: int, options: StrategyOptions) -> tuple[Path, ModelConfig]:
    """The model's folder and config, once the folder, the tp degree, the strategy options
    (gamma, skip list, a --profile of this model's shape) and the weights' index check out
    (UserError otherwise). No weights are read."""
    path = Path(resolve_model_path(model))
    if not path.is_dir():
        raise UserError(f"model path {str(path)!r} does not exist or is not a folder")
    config = load_config(path)
    check_shardable(config, tp)
    check_options(options, config)
    checkpoint_files(path)  # the weights are there and readable (a corrupt file: one line)
    return path, config


def describe_kv(kv: KVBudget) -> str:
    """A KV cache in a few words, for logs and errors."""
    what = (f"{kv.pages} pages of {kv.page} positions" if kv.paged
            else f"{kv.pages} fixed slots of {kv.page} positions")
    return f"{kv.tokens} tokens ({what}, {kv.bytes / 2 ** 20:.1f} MiB)"


def _source(budget: ReplicaBudget, where: str) -> str:
    return kv_source(budget.kv_cache_memory, budget.memory_utilization, where)


def check_kv(kv: KVBudget, budget: ReplicaBudget, prefix: str = "",
             where: str = "the memory free after the weights") -> None:
    """Refuse a KV cache that holds no row at all, or none of ``budget.max_model_len``
    (one line naming both token counts)."""
    need = row_capacity(budget.max_model_len, 0) if budget.max_model_len else None
    if kv.pages >= 1 and (need is None or kv.holds(need)):
        return
    row = (f"one row of --max-model-len {budget.max_model_len} needs {need} tokens"
           if need is not None else f"one row needs up to {kv.capacity} tokens")
    raise UserError(f"{prefix}the KV cache holds {kv.tokens} tokens per rank "
                    f"({_source(budget, where)}); {row} (prompt, new tokens and the draft "
                    "lookahead): give more --kv-cache-memory or a smaller --max-model-len")


def check_kv_memory(config: ModelConfig, tp: int, dtype: str, device: str,
                    budget: ReplicaBudget, node_bytes: int | None) -> None:
    """Refuse, before any replica starts, a budget whose KV cache cannot hold one row of
    ``budget.max_model_len``, by engine/memory.py's rule from the model config: the
    ``--kv-cache-memory`` given, else ``--memory-utilization`` of the largest node's memory
    with nothing else on it (``node_bytes``: a GPU's on cuda, half a CPU node's; None:
    unknown, only a given ``--kv-cache-memory`` is checked). The shards plan again beside
    their weights, and refuse what does not fit there."""
    if budget.kv_cache_memory is None and not node_bytes:
        return
    free = (node_bytes if device == "cuda" else node_bytes // 2) if node_bytes else 0
    kv = plan_kv(per_token=kv_bytes_per_token_of(config, tp, resolve_dtype(dtype)), free=free,
                 capacity=budget.capacity or row_capacity(config.max_position_embeddings, 0),
                 paged=not budget.fixed_slots, page=page_size(default_backend(device)),
                 cuda=device == "cuda", kv_cache_memory=budget.kv_cache_memory,
                 memory_utilization=budget.memory_utilization, max_num_seqs=budget.max_num_seqs)
    check_kv(kv, budget, where="the largest node's memory, before the weights")
