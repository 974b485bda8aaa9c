"""The engine as the jobs' dispatcher sees it (Ray ObjectRefs), and what Ray's errors mean.

The dispatcher (runtime/dispatch.py) knows nothing of Ray: it submits rows, waits for handles,
and asks whether a failure was the replica's (restart it, retry its rows) or the row's own
(its error row). Both answers need Ray, so they live here.
"""

from __future__ import annotations

from typing import Any

import ray
import torch
from ray import exceptions as rx

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.scheduler import Work
from knapspec_dist.errors import first_line
from knapspec_dist.runtime.messages import KVReport
from knapspec_dist.runtime.ray_engine import RayEngine

#: Errors that say the replica (an actor, a worker, a node) died, not the row.
REPLICA_FAILURES = tuple(getattr(rx, n) for n in (
    "RayActorError", "WorkerCrashedError", "NodeDiedError", "ObjectLostError",
    "OwnerDiedError", "ObjectFetchTimedOutError", "LocalRayletDiedError",
    "RaySystemError", "OutOfMemoryError") if hasattr(rx, n))

#: Out of memory: Ray's OOM killer stopped the worker (ray.exceptions.OutOfMemoryError), or a
#: shard or coordinator ran out (torch's OutOfMemoryError, Python's MemoryError). A replica
#: failure: the replica restarts with half its KV cache and rows in flight, and its rows are
#: retried.
OUT_OF_MEMORY = tuple(t for t in (getattr(rx, "OutOfMemoryError", None),
                                  getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None), MemoryError)
                      if isinstance(t, type))


class EngineBackend:
    """runtime.dispatch.Backend over :class:`~knapspec_dist.runtime.ray_engine.RayEngine`."""

    def __init__(self, engine: RayEngine):
        self.engine = engine
        self.num_replicas = engine.num_replicas

    def submit(self, replica: int, prompt_ids: list[int], config: GenerationConfig,
               key: object = None) -> Any:
        return self.engine.submit(replica, prompt_ids, config, key)

    def work(self) -> Work | None:
        """Tokens generated and prefilled so far, finished rows or not (None: not known
        right now)."""
        return self.engine.work()

    def wait(self, handles: list, timeout: float) -> list:
        ready, _ = ray.wait(handles, num_returns=1, timeout=timeout)
        if ready:  # collect everything else that is ready too
            more, _ = ray.wait(handles, num_returns=len(handles), timeout=0)
            ready = list({r: None for r in ready + more})
        return ready

    def result(self, handle) -> Any:
        return ray.get(handle)

    def kv_report(self) -> KVReport | None:
        """The replicas' KV cache and its use so far (None: not known right now)."""
        return self.engine.kv_report()

    def restart(self, replica: int, smaller: bool = False) -> None:
        """Restart ``replica``; ``smaller`` (after out of memory): with half its KV cache
        and half its rows in flight (RayEngine.restart_replica)."""
        self.engine.restart_replica(replica, smaller=smaller)

    def is_replica_failure(self, exc: BaseException) -> bool:
        return is_replica_failure(exc)

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return is_out_of_memory(exc)


def _chain(exc: BaseException | None):
    """``exc`` and what it wraps: RayTaskError's ``cause`` (what the coordinator saw, e.g. a
    shard's error), then ``__cause__``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = getattr(exc, "cause", None) or exc.__cause__


def is_out_of_memory(exc: BaseException) -> bool:
    """True when ``exc`` is (or wraps) an out-of-memory failure."""
    return any(isinstance(e, OUT_OF_MEMORY) for e in _chain(exc))


def is_replica_failure(exc: BaseException) -> bool:
    """True when ``exc`` says the replica (not the row) failed: a dead actor or worker, or
    out of memory."""
    return any(isinstance(e, REPLICA_FAILURES + OUT_OF_MEMORY) for e in _chain(exc))


def describe_error(exc: BaseException) -> str:
    """One line for the error column: the row's original exception, without Ray's wrapping."""
    cause = getattr(exc, "cause", None)
    if cause is not None and not isinstance(cause, type(exc)):
        exc = cause
    first = first_line(exc) if str(exc).strip() else ""
    name = type(exc).__name__
    if name.startswith("RayTaskError(") and name.endswith(")"):
        name = name[len("RayTaskError("):-1]
    return f"{name}: {first}" if first else name
