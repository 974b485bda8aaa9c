"""Can this model run ``tp`` ways with this strategy? Answered from small files only.

The one check before anything costly: the batch job calls it before it tokenizes a single
row, the engine before it starts an actor. A bad ``--model``, a tp degree the heads do not
divide, a bad strategy option or unreadable weights then fail in seconds, with one line.
"""

from __future__ import annotations

from pathlib import Path

from knapspec_dist.errors import UserError
from knapspec_dist.model.config import ModelConfig, load_config
from knapspec_dist.model.embedded import resolve_model_path
from knapspec_dist.model.weights import checkpoint_files
from knapspec_dist.parallel import check_shardable
from knapspec_dist.spec.options import StrategyOptions, check_options


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
