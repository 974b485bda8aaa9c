"""Ray runtime: replicas of tensor-parallel shard actors with a coordinator actor each.

The only layer that imports ``ray``: :mod:`.cluster` (joining Ray), :mod:`.setup` (the check
before any actor starts), :mod:`.replica` (placement groups and actors), :mod:`.shard` and
:mod:`.coordinator` (the actors), :mod:`.engine` (the Python API) and :mod:`.backend` (the
engine as the jobs' dispatcher sees it).
"""

from knapspec_dist.runtime.engine import Engine
from knapspec_dist.runtime.replica import StartupError
from knapspec_dist.runtime.setup import check_setup

__all__ = ["Engine", "StartupError", "check_setup"]
