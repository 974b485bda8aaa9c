"""Ray runtime: replicas of tensor-parallel shard actors with a coordinator actor each."""

from .engine import Engine, StartupError

__all__ = ["Engine", "StartupError"]
