"""Tensor parallelism from outside the model: process group, collectives, sharded layers and
sliced loading. It knows nothing of speculation (speculation/spmd.py runs strategies SPMD)."""

from knapspec_dist.parallel.comm import Comm
from knapspec_dist.parallel.group import (
           destroy_distributed,
           free_port,
           init_distributed,
)
from knapspec_dist.parallel.layers import Layout, check_shardable, layout
from knapspec_dist.parallel.loading import load_sharded, parameter_bytes

__all__ = ["Comm", "Layout", "check_shardable", "destroy_distributed", "free_port",
           "init_distributed", "layout", "load_sharded", "parameter_bytes"]
