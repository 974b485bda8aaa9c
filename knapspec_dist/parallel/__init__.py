"""Tensor parallelism from outside the model: sharded loading, TP collectives, SPMD helpers."""

from knapspec_dist.parallel.tp import (Comm, Layout, SyncedSelector, check_shardable, destroy_distributed, free_port,
                 init_distributed, kv_heads, layout, load_sharded, parameter_bytes, spmd_strategy)

__all__ = ["Comm", "Layout", "SyncedSelector", "check_shardable", "destroy_distributed",
           "free_port", "init_distributed", "kv_heads", "layout", "load_sharded",
           "parameter_bytes", "spmd_strategy"]
