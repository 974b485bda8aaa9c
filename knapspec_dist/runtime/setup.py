"""Can this model run ``tp`` ways with this strategy? Answered from small files only.

The one check before anything costly: the batch job calls it before it tokenizes a single
row, the engine before it starts an actor. A bad ``--model``, a tp degree the heads do not
divide, a bad strategy option or unreadable weights then fail in seconds, with one line.
"""

from __future__ import annotations

from pathlib import Path

from knapspec_dist.engine.memory import kv_bytes_per_token_of, rows_that_fit
from knapspec_dist.errors import UserError
from knapspec_dist.model.config import ModelConfig, load_config
from knapspec_dist.model.embedded import resolve_model_path
from knapspec_dist.model.weights import checkpoint_files, resolve_dtype
from knapspec_dist.parallel import check_shardable
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


def check_batch_memory(config: ModelConfig, tp: int, dtype: str, device: str,
                       max_num_seqs: int | None, capacity: int, node_bytes: int | None) -> None:
    """Refuse a ``max_num_seqs`` whose KV caches cannot fit even on the largest node with
    nothing else on it (``node_bytes``: its memory, a GPU's on cuda; None: unknown, not
    checked), by engine/memory.py's rule (half of a CPU node's memory). Called before any
    replica starts; the shards then cap a number that fits here but not next to their
    weights, with a warning."""
    if max_num_seqs is None or not node_bytes:
        return
    free = node_bytes if device == "cuda" else node_bytes // 2
    per_token = kv_bytes_per_token_of(config, tp, resolve_dtype(dtype))
    fits = rows_that_fit(free, per_token, capacity)
    if max_num_seqs > fits:
        raise UserError(
            f"--max-num-seqs {max_num_seqs} does not fit in memory: a row's KV cache of "
            f"{capacity} positions takes {per_token * capacity / 2 ** 20:.1f} MiB per rank and "
            f"the largest node offers {free / 2 ** 30:.1f} GiB for caches, so at most {fits} "
            f"row(s) per replica (before the weights); lower --max-num-seqs or "
            f"--max-model-len, or leave --max-num-seqs out to size it from memory")
