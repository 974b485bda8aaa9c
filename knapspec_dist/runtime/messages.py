"""The records that cross the Ray boundary between the engine, a replica's coordinator and its
shards: one dataclass per message, so that no side indexes a tuple or reads a dict by key.

The engine -> coordinator -> shards direction carries how to measure a profile
(``MeasureOptions``), what each rank may hold (``ReplicaBudget``) and the rows to admit
(``Admission``); the way back carries a rank's load report (``ShardInfo``), a batch of rounds'
outcome (``StepResult``), a measurement under way (``Measuring``) and a replica's state
(``ReplicaInfo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from knapspec_dist.engine.generation import GenerationResult
from knapspec_dist.engine.scheduler import Work


@dataclass(frozen=True)
class MeasureOptions:
    """How a replica measures a latency profile when none is stored: at ``contexts``
    (None: chosen from ``need``), ``repeats`` times each. ``need``: the longest context the
    work runs, which a stored profile must cover (profiles/store.py)."""

    contexts: tuple[int, ...] | None = None
    repeats: int = 3
    need: int | None = None


@dataclass(frozen=True)
class ReplicaBudget:
    """What each rank's cache holds: ``capacity`` positions per row (None: the model's
    window) and ``max_num_seqs`` rows (None: what the free memory holds, engine/memory.py)."""

    capacity: int | None = None
    max_num_seqs: int | None = None


@dataclass(frozen=True)
class ShardInfo:
    """A rank's report once its weights are loaded."""

    rank: int
    params: int  # bytes of this rank's weights
    device: dict  # profiles/device.py's description of the rank's device
    pid: int


@dataclass(frozen=True)
class Admission:
    """A row the coordinator hands every rank's scheduler: its id, prompt and sampling key."""

    rid: int
    prompt_ids: tuple[int, ...]
    key: object


@dataclass
class StepResult:
    """One shard call's outcome: rows finished (id, result) and refused (id, message), the
    call's wall seconds, whether rows remain, the ``Work`` done by every row in the call and
    the scheduler steps run."""

    finished: list[tuple[int, GenerationResult]] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)
    elapsed_s: float = 0.0
    busy: bool = False
    work: Work = field(default_factory=Work)
    steps: int = 0


@dataclass(frozen=True)
class Measuring:
    """A profile measurement under way: what the start-up wait does not count against its
    timeout. ``since``: its start, in epoch seconds."""

    contexts: tuple[int, ...]
    repeats: int
    since: float


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica's state as its coordinator reports it: rows served, rows decoding at once,
    and which profile prices it (key, path, origin; None for ar and static)."""

    replica: int
    served: int = 0
    max_num_seqs: int | None = None
    profile: dict | None = None

    @property
    def profile_key(self) -> str | None:
        return self.profile["key"] if self.profile else None
