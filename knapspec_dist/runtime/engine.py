"""The Ray engine: replicas of tensor-parallel shard actors, each with a coordinator actor.

```
with Engine("smollm2", tp=1, replicas=2, strategy="knapspec") as engine:
    results = engine.generate(["Summarize ..."], max_new_tokens=64)
```

Per replica: one placement group (STRICT_PACK: all ranks on one node; bundles {"GPU": 1,
"CPU": c} on CUDA, {"CPU": c} on CPU), one shard actor per rank (its weight slices, its
slice of the KV cache, torch.distributed over gloo or NCCL; rank 0 picks the port) and one
coordinator actor (latency profile, TPT search, continuous batching of the requests). The
driver sends one call per prompt; the coordinator admits prompts into the shards' batch of up
to ``max_num_seqs`` rows; decoding runs SPMD inside the shards: no Ray call per token or
sublayer.

Every start-up failure (indivisible heads, missing checkpoint, a rank that dies or cannot be
placed) raises a clear error after removing every actor and placement group it created.

Where Ray runs: ``ray.init(address=address)`` unless Ray is already initialized in this
process (``"auto"`` joins a running cluster, ``"local"`` always starts a new one; None is
Ray's default: RAY_ADDRESS, else a cluster ``ray start`` left on this machine, else a new
local one; the engine then shuts down the Ray it started). On a cluster,
the package must be importable on every node (installed, or shipped with the job's
``runtime_env``) and the model folder must exist at the same path on every node.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, fields, replace
from pathlib import Path

from knapspec_dist.errors import UserError
from knapspec_dist.engine.generation import GenerationConfig, GenerationResult

log = logging.getLogger(__name__)


class StartupError(UserError):
    """The engine could not start a replica (resources, a crashed rank); nothing is left over."""


@dataclass
class _Replica:
    index: int
    pg: object = None
    shards: list = None
    coordinator: object = None
    info: dict = None


class Engine:
    """Replicas of TP shard actors behind one Python API (a context manager)."""

    def __init__(self, model: str, tp: int = 1, replicas: int = 1, strategy: str = "knapspec",
                 dtype: str = "fp32", device: str = "cpu", address: str | None = None, *,
                 cpus_per_rank: int = 1, startup_timeout_s: float = 300.0,
                 profile_contexts: list[int] | None = None, profile_repeats: int = 3,
                 profile_need: int | None = None, max_num_seqs: int | None = None,
                 _fail_rank: int | None = None, **options):
        """``options`` are StrategyOptions fields (skip, gamma, tau_conf, profile, interval,
        coupled, objective, select_once). ``cpus_per_rank`` CPUs are reserved per rank, and
        each rank runs that many torch threads (OMP_NUM_THREADS). ``profile_contexts`` /
        ``profile_repeats``: the measurement made when no stored profile matches;
        ``profile_need``: the longest context the work will run, which a stored profile must
        cover and a measured one does (profiles/store.py); it also sizes each row's KV cache
        (default: the model's window). ``max_num_seqs``: rows each replica decodes at once
        (continuous batching; default: what the memory left after the weights holds,
        execution/memory.py)."""
        from knapspec_dist.model.config import load_config
        from knapspec_dist.model.embedded import resolve_model_path
        from knapspec_dist.model.tokenizer import load_tokenizer
        from knapspec_dist.model.weights import checkpoint_files, resolve_dtype
        from knapspec_dist.parallel import check_shardable

        if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or max_num_seqs < 1):
            raise UserError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        for name, value in (("tp", tp), ("replicas", replicas), ("cpus_per_rank", cpus_per_rank)):
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be an integer >= 1, got {value!r}")
        if device not in ("cpu", "cuda"):
            raise UserError(f"unknown device {device!r}; choose cpu or cuda")
        resolve_dtype(dtype)
        path = Path(resolve_model_path(model))
        if not path.is_dir():
            raise UserError(f"model path {str(path)!r} does not exist or is not a folder")
        self.config = load_config(path)
        check_shardable(self.config, tp)
        checkpoint_files(path)  # the weights exist (UserError otherwise)
        self.options = self._strategy_options(strategy, options)

        self.path, self.tp, self.dtype, self.device = str(path), tp, dtype, device
        self.num_replicas, self.cpus_per_rank = replicas, cpus_per_rank
        self.startup_timeout_s = startup_timeout_s
        self.measure = {"contexts": profile_contexts, "repeats": profile_repeats,
                        "need": profile_need}
        from knapspec_dist.engine.sequence import row_capacity

        self.batching = {"max_num_seqs": max_num_seqs,
                         "capacity": row_capacity(profile_need, 0) if profile_need else None}
        self._fail_rank = _fail_rank
        self._id = uuid.uuid4().hex[:8]
        try:
            self.tokenizer = load_tokenizer(path)
        except UserError as e:
            log.warning("%s; text prompts are unavailable, pass token ids",
                        str(e).strip().splitlines()[0])
            self.tokenizer = None
        self.last_job: dict | None = None

        import ray

        self._owns_ray = False
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=True)
            self._owns_ray = True
        elif address is not None:
            log.info("Ray is already initialized; ignoring address=%r", address)
        self._replicas: list[_Replica | None] = [None] * replicas
        try:
            self._check_resources()
            self._replicas = self._start_replicas(list(range(replicas)))
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ replicas

    def _start_replicas(self, indices: list[int]) -> list[_Replica]:
        """Start replicas together, phase by phase (placement, actors, rendezvous, loading,
        profile), so their weights load in parallel. Any failure stops all of them."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from knapspec_dist.runtime.coordinator import Coordinator
        from knapspec_dist.runtime.shard import Shard

        reps = [_Replica(i, shards=[]) for i in indices]
        cuda = self.device == "cuda"
        bundle = {"CPU": self.cpus_per_rank, **({"GPU": 1} if cuda else {})}
        started = time.perf_counter()
        try:
            for rep in reps:
                rep.pg = placement_group([dict(bundle) for _ in range(self.tp)],
                                         strategy="STRICT_PACK", name=self._tag(rep.index))
            ready = {rep.pg.ready(): f"replica {rep.index}" for rep in reps}
            self._wait(ready, "be placed", placement=bundle)
            env = {"env_vars": {"OMP_NUM_THREADS": str(self.cpus_per_rank)}}
            shard_cls, coordinator_cls = ray.remote(Shard), ray.remote(Coordinator)
            for rep in reps:
                for rank in range(self.tp):
                    rep.shards.append(shard_cls.options(
                        name=f"{self._tag(rep.index)}-rank{rank}", num_cpus=self.cpus_per_rank,
                        num_gpus=1 if cuda else 0, max_restarts=0, runtime_env=env,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            rep.pg, placement_group_bundle_index=rank),
                    ).remote(rep.index, rank, self.tp, self.cpus_per_rank, self.device))
                rep.coordinator = coordinator_cls.options(
                    name=f"{self._tag(rep.index)}-coordinator", num_cpus=0, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        rep.pg, placement_group_bundle_index=0),
                ).remote(rep.index, self.path, self.config.vocab_size, self.tp, self.dtype)
            addresses = self._wait({rep.shards[0].rendezvous.remote(): f"replica {rep.index} "
                                    f"rank 0" for rep in reps}, "start")
            setups = {}
            for rep, (address, port) in zip(reps, addresses):
                for rank, shard in enumerate(rep.shards):
                    fail = (rep.index, rank) == self._fail_rank or rank == self._fail_rank
                    setups[shard.setup.remote(self.path, address, port, self.dtype, fail=fail)] = \
                        f"replica {rep.index} rank {rank}"
            infos = self._wait(setups, "load its shard")
            for rep in reps:
                rep.info = {"ranks": infos[:self.tp]}
                infos = infos[self.tp:]
            prepared = self._wait({rep.coordinator.prepare.remote(
                rep.shards, self.options, rep.info["ranks"], self.measure, self.batching):
                f"replica {rep.index}" for rep in reps}, "prepare")
            for rep, info in zip(reps, prepared):
                rep.info.update(info)
        except BaseException:
            for rep in reps:
                self._stop_replica(rep)
            raise
        for rep in reps:
            log.info("replica %d ready: tp=%d, %s, profile %s (%.1fs)", rep.index, self.tp,
                     self.options.name, rep.info.get("profile_key"),
                     time.perf_counter() - started)
        return reps

    def _check_resources(self) -> None:
        """Fail in seconds, naming what is missing, when the cluster cannot hold the replicas:
        GPUs (one per rank on CUDA, ``tp`` of them on one node) and CPUs (``cpus_per_rank``
        per rank), instead of waiting for placement groups that never come."""
        import ray

        need = {"CPU": self.cpus_per_rank}
        if self.device == "cuda":
            need["GPU"] = 1
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        total = {k: sum(n.get(k, 0) for n in nodes) for k in need}
        node_max = {k: max((n.get(k, 0) for n in nodes), default=0) for k in need}
        ranks = self.tp * self.num_replicas
        for k, per_rank in need.items():
            if total[k] < per_rank * ranks:
                raise StartupError(
                    f"--device {self.device} with tp {self.tp} x replicas {self.num_replicas} "
                    f"needs {per_rank * ranks:g} {k}(s) ({per_rank:g} per rank); the Ray cluster "
                    f"has {total[k]:g}")
            if node_max[k] < per_rank * self.tp:
                raise StartupError(
                    f"tp {self.tp} needs {per_rank * self.tp:g} {k}(s) on one node (a replica's "
                    f"ranks share a node); the largest node of the Ray cluster has {node_max[k]:g}")

    def _strategy_options(self, strategy: str, options: dict):
        """StrategyOptions from keyword options, checked here before any actor starts."""
        from knapspec_dist.spec.options import StrategyOptions, check_options

        known = {f.name for f in fields(StrategyOptions)} - {"name"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UserError(f"unknown engine option(s) {', '.join(unknown)}; strategy options "
                            f"are {', '.join(sorted(known))}")
        opts = StrategyOptions(name=strategy, **options)
        check_options(opts, self.config)
        return opts

    def _tag(self, index: int) -> str:
        return f"knapspec-{self._id}-r{index}"

    def _wait(self, refs: dict, what: str, placement: dict | None = None) -> list:
        """Results of ``refs`` (ref -> who), in order; the first failure, or the start-up
        timeout, raises at once."""
        import ray

        deadline = time.monotonic() + self.startup_timeout_s
        order = {r: i for i, r in enumerate(refs)}
        out = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                who = ", ".join(refs[r] for r in pending)
                if placement is not None:
                    raise StartupError(
                        f"{who}: could not reserve {self.tp} x {placement} on one node within "
                        f"{self.startup_timeout_s:.0f}s (cluster resources: "
                        f"{ray.cluster_resources()}, available: {ray.available_resources()})")
                raise StartupError(f"{who}: did not {what} within {self.startup_timeout_s:.0f}s")
            ref = ready[0]
            who = refs[ref]
            try:
                out[order[ref]] = ray.get(ref)
            except UserError as e:  # RayTaskError(UserError) is a UserError too
                cause = getattr(e, "cause", e)
                raise UserError(f"{who}: {cause}") from None
            except ray.exceptions.RayActorError as e:
                raise StartupError(f"{who} failed to {what}: its actor died "
                                   f"({_first_line(e)})") from None
            except ray.exceptions.RayTaskError as e:
                raise StartupError(f"{who} failed to {what}: "
                                   f"{_first_line(getattr(e, 'cause', e))}") from e
        return out

    def _stop_replica(self, rep: _Replica | None) -> None:
        """Kill the replica's actors and remove its placement group; wait until they are gone."""
        if rep is None:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        actors = [a for a in [*(rep.shards or []), rep.coordinator] if a is not None]
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

    def restart_replica(self, replica: int) -> None:
        """Kill a replica's actors and placement group, and start it again."""
        self._check_replica(replica)
        log.warning("restarting replica %d", replica)
        self._stop_replica(self._replicas[replica])
        self._replicas[replica] = None
        self._replicas[replica] = self._start_replicas([replica])[0]

    def reconfigure(self, strategy: str | None = None, **options) -> None:
        """Switch every replica to another strategy / options without reloading weights
        (e.g. the ``ar`` baseline, then ``knapspec``); the profile is resolved again."""
        self.options = self._strategy_options(strategy or self.options.name, options)
        refs = {rep.coordinator.prepare.remote(rep.shards, self.options, rep.info["ranks"],
                                               self.measure, self.batching):
                f"replica {rep.index}"
                for rep in self._replicas if rep is not None}
        for rep, info in zip([r for r in self._replicas if r is not None],
                             self._wait(refs, "reconfigure")):
            rep.info.update(info)

    def shutdown(self) -> None:
        for i, rep in enumerate(getattr(self, "_replicas", [])):
            self._stop_replica(rep)
            self._replicas[i] = None
        if getattr(self, "_owns_ray", False):
            import ray

            ray.shutdown()
            self._owns_ray = False

    def _check_replica(self, replica: int) -> None:
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} outside 0..{self.num_replicas - 1}")

    def measure_profile(self, contexts: list[int], *, replica: int = 0, batch: int = 1,
                        max_q: int = 11, repeats: int = 5, warmup: int = 1,
                        fill: str = "random"):
        """A latency profile measured on one replica's shards (all ranks, MAX over ranks,
        with the all-reduce when tp > 1); see profiles/profiler.py for the method."""
        import ray

        from knapspec_dist.profiles.profile import LatencyProfile

        self._check_replica(replica)
        rep = self._replicas[replica]
        refs = [s.measure_profile.remote(list(contexts), repeats, batch=batch, max_q=max_q,
                                         warmup=warmup, fill=fill) for s in rep.shards]
        return LatencyProfile.from_json(ray.get(refs)[0])

    def replica_info(self, replica: int) -> dict:
        rep = self._replicas[replica]
        return dict(rep.info) if rep and rep.info else {}

    # ------------------------------------------------------------------ requests

    def submit(self, replica: int, prompt_ids: list[int], config: GenerationConfig):
        """An ObjectRef resolving to the GenerationResult (text filled) of one prompt."""
        self._check_replica(replica)
        rep = self._replicas[replica]
        if rep is None or rep.coordinator is None:
            raise RuntimeError(f"replica {replica} is not running (restart_replica)")
        return rep.coordinator.generate.remote(list(prompt_ids), config)

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError(f"{self.path}: no tokenizer; pass prompts as token ids")
            from knapspec_dist.model.tokenizer import encode

            return encode(self.tokenizer, prompt, chat)
        return list(prompt)

    def generate(self, prompts: list[str] | list[list[int]], config: GenerationConfig | None = None,
                 chat: bool = False, **sampling) -> list[GenerationResult]:
        """Generate for every prompt, spread round-robin over the replicas; results in input
        order. ``sampling``: max_new_tokens, stop_at_eos, temperature, top_k, top_p, seed
        (overriding ``config``). Raises the first failed prompt's error."""
        import ray

        config = _config(config, sampling)
        ids = [self.encode(p, chat) for p in prompts]
        start = time.perf_counter()
        refs = [self.submit(i % self.num_replicas, p, config) for i, p in enumerate(ids)]
        results = ray.get(refs)
        wall = time.perf_counter() - start
        from knapspec_dist.runtime.accounting import job_summary

        self.last_job = job_summary(results, wall, self.num_replicas)
        return results


def _config(config: GenerationConfig | None, sampling: dict) -> GenerationConfig:
    from knapspec_dist.engine.sampling import SamplingConfig

    config = config or GenerationConfig()
    top = {k: sampling.pop(k) for k in ("max_new_tokens", "stop_at_eos") if k in sampling}
    valid = {f.name for f in fields(SamplingConfig)}
    unknown = sorted(set(sampling) - valid)
    if unknown:
        raise UserError(f"unknown sampling option(s) {', '.join(unknown)}; use "
                        f"max_new_tokens, stop_at_eos, {', '.join(sorted(valid))}")
    if sampling:
        config = replace(config, sampling=replace(config.sampling, **sampling))
    return replace(config, **top) if top else config


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _wait_gone(actor_ids: list[str], pg_id: str | None, timeout_s: float = 30.0) -> None:
    """Block until the actors are DEAD and the placement group REMOVED (GCS state)."""
    import ray
    from ray._private import state

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
