"""Starting and stopping replicas: placement groups, shard and coordinator actors, rendezvous.

Per replica: one placement group (STRICT_PACK: all ranks on one node; bundles {"GPU": 1,
"CPU": c} on CUDA, {"CPU": c} on CPU), one shard actor per rank (rank 0 picks the
torch.distributed port) and one coordinator actor. Replicas start together, phase by phase
(placement, actors, rendezvous, loading, profile), so their weights load in parallel; the
first failure or a phase past the start-up timeout stops all of them (time a coordinator
spends measuring a latency profile is not counted: it is logged as it goes), and stopping waits
until Ray reports every actor dead and the placement group removed, so nothing is left over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import ray
import torch
from ray._private import state
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from knapspec_dist.errors import UserError, first_line
from knapspec_dist.runtime.coordinator import Coordinator
from knapspec_dist.runtime.messages import (
    MeasureOptions,
    Measuring,
    ReplicaBudget,
    ReplicaInfo,
    ShardInfo,
)
from knapspec_dist.runtime.shard import Shard
from knapspec_dist.speculation.options import StrategyOptions

log = logging.getLogger(__name__)


class StartupError(UserError):
    """The engine could not start a replica (resources, a crashed rank); nothing is left over."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica of one engine is made of, and how long its start may take."""

    tag: str  # prefix of the actors' and placement groups' names: knapspec-<engine id>
    path: str  # the model folder, the same on every node
    vocab_size: int
    tp: int
    dtype: str
    device: str
    cpus_per_rank: int  # a rank's torch threads
    startup_timeout_s: float
    reserved_cpus: float | None = None  # the CPUs Ray reserves per rank; None: cpus_per_rank

    def name(self, index: int) -> str:
        return f"{self.tag}-r{index}"

    @property
    def bundle(self) -> dict:
        """The resources of one rank."""
        cpus = self.cpus_per_rank if self.reserved_cpus is None else self.reserved_cpus
        return {"CPU": cpus, **({"GPU": 1} if self.device == "cuda" else {})}


@dataclass
class Replica:
    index: int
    pg: object = None  # its PlacementGroup
    shards: list = field(default_factory=list)  # shard actor handles, by rank
    coordinator: object = None
    ranks: list[ShardInfo] = field(default_factory=list)  # each rank's load report
    info: ReplicaInfo | None = None  # its coordinator's report, once prepared


def auto_cpus_per_rank(tp: int, replicas: int, device: str) -> int:
    """CPUs per rank when the user names none. On a CPU the ranks share the cluster's cores,
    as vLLM's automatic thread binding does: a rank's torch threads run its matrix products,
    and one thread per rank left half of a 2-core machine idle. The rule: every rank the same
    share, all ``tp x replicas`` ranks within the cluster's CPUs and within those free now
    (another engine's are not shared again), a replica's ``tp`` within its largest node's. On
    CUDA a rank's work is the GPU's: 1."""
    if device == "cuda":
        return 1
    return share_cores(node_cpus(), int(ray.available_resources().get("CPU", 0)), tp, replicas)


def alive_nodes() -> list[dict]:
    """The resources (``CPU``, ``GPU``, ``memory``, ...) of each node of the Ray cluster alive
    now."""
    return [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]


def node_cpus() -> list[int]:
    """CPUs of each alive node."""
    return [int(n.get("CPU", 0)) for n in alive_nodes()]


def share_cores(nodes: list[int], free: int, tp: int, replicas: int) -> int:
    """The rule of ``auto_cpus_per_rank`` over the nodes' CPU counts and the cluster's CPUs
    free now; at least 1."""
    if not nodes:
        return 1
    ranks = tp * replicas
    return max(1, min(max(nodes) // tp, sum(nodes) // ranks, free // ranks))


def check_resources(spec: ReplicaSpec, replicas: int) -> None:
    """Fail in seconds, naming what is missing, when the cluster cannot hold the replicas:
    GPUs (one per rank on CUDA, ``tp`` of them on one node) and CPUs (``cpus_per_rank``
    per rank), instead of waiting for placement groups that never come."""
    need = spec.bundle
    nodes = alive_nodes()
    total = {k: sum(n.get(k, 0) for n in nodes) for k in need}
    node_max = {k: max((n.get(k, 0) for n in nodes), default=0) for k in need}
    ranks = spec.tp * replicas
    for k, per_rank in need.items():
        if total[k] < per_rank * ranks:
            raise StartupError(
                f"--device {spec.device} with tp {spec.tp} x replicas {replicas} "
                f"needs {per_rank * ranks:g} {k}(s) ({per_rank:g} per rank); the Ray cluster "
                f"has {total[k]:g}")
        if node_max[k] < per_rank * spec.tp:
            raise StartupError(
                f"tp {spec.tp} needs {per_rank * spec.tp:g} {k}(s) on one node (a replica's "
                f"ranks share a node); the largest node of the Ray cluster has {node_max[k]:g}")


def node_memory(device: str) -> int | None:
    """Bytes of memory of the cluster's largest node (Ray's ``memory`` plus object store:
    about what was available when it started); on cuda, the first local GPU's (None when
    this process sees no GPU: the shards still cap the batch)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(0).total_memory)
    sizes = [n.get("memory", 0) + n.get("object_store_memory", 0) for n in alive_nodes()]
    return int(max(sizes)) if sizes and max(sizes) > 0 else None


def start_replicas(spec: ReplicaSpec, indices: list[int], options: StrategyOptions,
                   measure: MeasureOptions, budget: ReplicaBudget) -> list[Replica]:
    """Start the replicas ``indices`` and prepare their strategy; any failure stops all."""
    reps = [Replica(i) for i in indices]
    started = time.perf_counter()
    try:
        for rep in reps:
            rep.pg = placement_group([spec.bundle for _ in range(spec.tp)],
                                     strategy="STRICT_PACK", name=spec.name(rep.index))
        wait(spec, {rep.pg.ready(): f"replica {rep.index}" for rep in reps}, "be placed",
             placement=True)
        _start_actors(spec, reps)
        addresses = wait(spec, {rep.shards[0].rendezvous.remote(): f"replica {rep.index} rank 0"
                                for rep in reps}, "start")
        setups = {}
        for rep, (address, port) in zip(reps, addresses):
            for rank, shard in enumerate(rep.shards):
                setups[shard.setup.remote(spec.path, address, port, spec.dtype)] = \
                    f"replica {rep.index} rank {rank}"
        infos = wait(spec, setups, "load its shard")
        for k, rep in enumerate(reps):
            rep.ranks = infos[k * spec.tp:(k + 1) * spec.tp]
        prepare_replicas(spec, reps, options, measure, budget, "prepare")
    except BaseException:
        for rep in reps:
            stop_replica(rep)
        raise
    for rep in reps:
        log.info("replica %d ready: tp=%d, %s, profile %s (%.1fs)", rep.index, spec.tp,
                 options.name, rep.info.profile_key, time.perf_counter() - started)
    return reps


def _start_actors(spec: ReplicaSpec, reps: list[Replica]) -> None:
    """One shard actor per bundle of the replica's placement group, the coordinator beside
    rank 0 (no resources of its own)."""
    env = {"env_vars": {"OMP_NUM_THREADS": str(spec.cpus_per_rank)}}
    shard_cls, coordinator_cls = ray.remote(Shard), ray.remote(Coordinator)
    for rep in reps:
        for rank in range(spec.tp):
            rep.shards.append(shard_cls.options(
                name=f"{spec.name(rep.index)}-rank{rank}", num_cpus=spec.bundle["CPU"],
                num_gpus=1 if spec.device == "cuda" else 0, max_restarts=0, runtime_env=env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    rep.pg, placement_group_bundle_index=rank),
            ).remote(rep.index, rank, spec.tp, spec.cpus_per_rank, spec.device))
        rep.coordinator = coordinator_cls.options(
            name=f"{spec.name(rep.index)}-coordinator", num_cpus=0, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                rep.pg, placement_group_bundle_index=0),
        ).remote(rep.index, spec.path, spec.vocab_size, spec.tp, spec.dtype)


def prepare_replicas(spec: ReplicaSpec, reps: list[Replica], options: StrategyOptions,
                     measure: MeasureOptions, budget: ReplicaBudget, what: str) -> None:
    """Have each coordinator resolve its profile and configure its shards for ``options``;
    its report becomes the replica's ``info``. Time a coordinator spends measuring a
    latency profile is not counted against the start-up timeout (it is logged instead)."""
    refs = {rep.coordinator.prepare.remote(rep.shards, options, rep.ranks, measure,
                                           budget): f"replica {rep.index}" for rep in reps}
    coordinators = {ref: rep.coordinator for ref, rep in zip(refs, reps)}
    for rep, info in zip(reps, wait(spec, refs, what, measuring=coordinators)):
        rep.info = info


#: How often a start-up wait asks the coordinators whether they are measuring a profile,
#: and how often it logs a measurement under way.
POLL_S, MEASURING_LOG_S = 5.0, 30.0


def _measuring(pending: list, coordinators: dict) -> Measuring | None:
    """What a pending replica's coordinator is measuring (``Coordinator.measuring_since``),
    or None; a coordinator that does not answer within a second counts as not measuring."""
    refs = [coordinators[r].measuring_since.remote() for r in pending if r in coordinators]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0) if refs else ([], [])
    for ref in ready:
        try:
            found = ray.get(ref)
        except ray.exceptions.RayError:  # its prepare failed or it died: the wait reports it
            continue
        if found:
            return found
    return None


def wait(spec: ReplicaSpec, refs: dict, what: str, placement: bool = False,
         measuring: dict | None = None) -> list:
    """Results of ``refs`` (ref -> who), in order; the first failure, or the start-up
    timeout, raises at once (``placement``: the refs are placement groups getting ready).
    ``measuring`` (ref -> its coordinator): time while one of them measures a latency
    profile does not count against the timeout."""
    timeout = spec.startup_timeout_s
    deadline = time.monotonic() + timeout
    order = {r: i for i, r in enumerate(refs)}
    out = [None] * len(refs)
    pending = list(refs)
    logged = -MEASURING_LOG_S
    while pending:
        now = time.monotonic()
        left = max(0.0, deadline - now)
        ready, pending = ray.wait(pending, num_returns=1,
                                  timeout=min(left, POLL_S) if measuring else left)
        if not ready and measuring and left > 0:
            busy = _measuring(pending, measuring)
            if busy is not None:
                deadline += time.monotonic() - now  # this slice is not counted
                since = time.time() - busy.since
                if since - logged >= MEASURING_LOG_S:
                    logged = since
                    log.info("measuring a latency profile (contexts %s, %d repeats) for %.0fs; "
                             "not counted against the %.0fs start-up timeout", list(busy.contexts),
                             busy.repeats, since, timeout)
            continue
        if not ready:
            who = ", ".join(refs[r] for r in pending)
            if placement:
                raise StartupError(
                    f"{who}: could not reserve {spec.tp} x {spec.bundle} on one node within "
                    f"{timeout:.0f}s (cluster resources: {ray.cluster_resources()}, "
                    f"available: {ray.available_resources()})")
            raise StartupError(f"{who}: did not {what} within {timeout:.0f}s")
        ref = ready[0]
        who = refs[ref]
        try:
            out[order[ref]] = ray.get(ref)
        except UserError as e:  # RayTaskError(UserError) is a UserError too
            cause = getattr(e, "cause", e)
            raise UserError(f"{who}: {cause}") from None
        except ray.exceptions.RayActorError as e:
            raise StartupError(f"{who} failed to {what}: its actor died "
                               f"({first_line(e)})") from None
        except ray.exceptions.RayTaskError as e:
            raise StartupError(f"{who} failed to {what}: "
                               f"{first_line(getattr(e, 'cause', e))}") from e
    return out


#: How long the engine waits for a coordinator to hear that its replica is being stopped.
STOP_NOTICE_S = 2.0


def stop_replica(rep: Replica | None) -> None:
    """Kill the replica's actors and remove its placement group; wait until they are gone.
    A prepared replica's coordinator hears it first, and dies first, so the deaths of ranks
    killed here are not reported as a replica's failure."""
    if rep is None:
        return
    if rep.coordinator is not None and rep.info is not None:
        try:
            ray.get(rep.coordinator.stop.remote(), timeout=STOP_NOTICE_S)
        except Exception as e:  # dead or unresponsive: it is killed all the same
            log.debug("stop notice: %s", e)
    actors = [a for a in [rep.coordinator, *rep.shards] if a is not None]
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # already dead
            log.debug("kill: %s", e)
    if rep.pg is not None:
        try:
            remove_placement_group(rep.pg)
        except Exception as e:
            log.debug("remove placement group: %s", e)
    _wait_gone([a._actor_id.hex() for a in actors], rep.pg.id.hex() if rep.pg else None)
    rep.shards, rep.coordinator, rep.pg = [], None, None


def _wait_gone(actor_ids: list[str], pg_id: str | None, timeout_s: float = 30.0) -> None:
    """Block until the actors are DEAD and the placement group REMOVED (GCS state)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [a for a in actor_ids
                 if (state.actors(actor_id=a) or {}).get("State") not in (None, "DEAD")]
        pg_left = False
        if pg_id is not None:
            table = ray.util.placement_group_table()
            pg_left = table.get(pg_id, {}).get("state") not in (None, "REMOVED")
        if not alive and not pg_left:
            return
        time.sleep(0.05)
    log.warning("actors %s or placement group %s still present after %.0fs", actor_ids, pg_id,
                timeout_s)
