"""Ray runtime: replicas of tensor-parallel shard actors with a coordinator actor each."""

from knapspec_dist.runtime.engine import Engine, StartupError

__all__ = ["Engine", "StartupError"]
