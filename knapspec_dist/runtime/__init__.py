"""Ray runtime: replicas of tensor-parallel shard actors with a coordinator actor each.

The only layer that imports ``ray``: :mod:`.cluster` (joining Ray), :mod:`.local_ray`
(the keeper of a Ray this process starts), :mod:`.setup` (the check
before any actor starts), :mod:`.replica` (placement groups and actors), :mod:`.shard` and
:mod:`.coordinator` (the actors), :mod:`.ray_engine` (the Python API) and :mod:`.backend` (the
engine as the jobs' dispatcher sees it).
"""

from knapspec_dist.runtime.ray_engine import RayEngine
from knapspec_dist.runtime.replica import StartupError
from knapspec_dist.runtime.setup import check_setup

__all__ = ["RayEngine", "StartupError", "check_setup"]
