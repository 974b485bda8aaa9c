"""The records that cross the Ray boundary between the engine, a replica's coordinator and its
shards: one dataclass per message, so that no side indexes a tuple or reads a dict by key.

The engine -> coordinator -> shards direction carries how to measure a profile
(``MeasureOptions``), what each rank may hold (``ReplicaBudget``) and the rows to admit
(``Admission``); the way back carries a rank's load report (``ShardInfo``), a batch of rounds'
outcome (``StepResult``), a measurement under way (``Measuring``), a replica's state
(``ReplicaInfo``), a rank's pages (``KVPages``) and a run's KV cache (``KVReport``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from knapspec_dist.engine.generation import GenerationResult
from knapspec_dist.engine.memory import MEMORY_UTILIZATION, KVBudget
from knapspec_dist.engine.pages import KVUse
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
    """What the user asked of each rank's KV cache (engine/memory.py's ``plan_kv`` turns it
    into a ``KVBudget`` on every rank): ``capacity`` positions per row at most (None: the
    model's window); ``max_model_len``: the row length the user asked for, which the pool
    must hold (None: not checked, a row too big is that row's error); ``kv_cache_memory``
    bytes per rank (None: ``memory_utilization`` of the memory free after the weights);
    ``max_num_seqs``: the cap on rows in flight (None: the device's default);
    ``fixed_slots``: fixed slots whatever the backend (a comparison's baseline)."""

    capacity: int | None = None
    max_num_seqs: int | None = None
    kv_cache_memory: int | None = None
    memory_utilization: float = MEMORY_UTILIZATION
    max_model_len: int | None = None
    fixed_slots: bool = False


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
    use: KVUse = field(default_factory=KVUse)  # the KV cache's peaks and waits in the call


@dataclass(frozen=True)
class Measuring:
    """A profile measurement under way: what the start-up wait does not count against its
    timeout. ``since``: its start, in epoch seconds."""

    contexts: tuple[int, ...]
    repeats: int
    since: float


@dataclass(frozen=True)
class ReplicaInfo:
    """A replica's state as its coordinator reports it: rows served, rows in flight at most,
    which profile prices it (key, path, origin; None for ar and static), the KV cache every
    rank holds (``kv``), how it was used (``use``) and the work done (``work``: its rounds
    give the mean rows decoding)."""

    replica: int
    served: int = 0
    max_num_seqs: int | None = None
    profile: dict | None = None
    kv: KVBudget | None = None
    use: KVUse = field(default_factory=KVUse)
    work: Work = field(default_factory=Work)

    @property
    def profile_key(self) -> str | None:
        return self.profile["key"] if self.profile else None


@dataclass(frozen=True)
class KVPages:
    """One rank's cache right now: its pages (fixed slots: its slots) and those no row
    holds; a leak is ``free < total`` with no row left."""

    rank: int
    total: int
    free: int


@dataclass(frozen=True)
class KVReport:
    """A run's KV cache over its replicas, for the job's progress and ``summary.json``: the
    pool per rank (the smallest replica's: one restarted after out of memory holds less),
    its peak use (the most any replica reserved, as a share of its pool), the rows in flight
    (the most at once, and the mean decoding per round) and the seconds rows waited for
    memory, summed over the replicas."""

    paged: bool
    page_size: int
    pages: int
    tokens: int
    bytes: int
    max_num_seqs: int
    peak_tokens: int
    peak_use: float
    peak_rows: int
    mean_rows: float
    memory_wait_s: float
    rows_waited: int

    @staticmethod
    def of(infos: list[ReplicaInfo]) -> KVReport | None:
        """The report of the replicas that have a KV cache (None: none has)."""
        infos = [i for i in infos if i.kv is not None]
        if not infos:
            return None
        small = min(infos, key=lambda i: i.kv.tokens).kv
        rounds = sum(i.work.rounds for i in infos)
        return KVReport(
            small.paged, small.page, small.pages, small.tokens, small.bytes, small.max_num_seqs,
            max(i.use.peak_tokens for i in infos),
            max(i.use.peak_tokens / i.kv.tokens if i.kv.tokens else 0.0 for i in infos),
            max(i.use.peak_rows for i in infos),
            sum(i.work.row_rounds for i in infos) / rounds if rounds else 0.0,
            sum(i.use.wait_s for i in infos), sum(i.use.waited for i in infos))

    def to_dict(self) -> dict:
        return asdict(self)
