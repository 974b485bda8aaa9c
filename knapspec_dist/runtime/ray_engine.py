"""The Ray engine: replicas of tensor-parallel shard actors, each with a coordinator actor.

```
with RayEngine("smollm2", tp=1, replicas=2, strategy="knapspec") as engine:
    results = engine.generate(["Summarize ..."], max_new_tokens=64)
```

A replica (runtime/replica.py) is one placement group of ``tp`` shard actors (their weight
slices, their slices of the KV cache, torch.distributed over gloo or NCCL) and one
coordinator actor (latency profile, TPT search, continuous batching of the requests). The
driver sends one call per prompt; the coordinator admits prompts into the shards' batch of up
to ``max_num_seqs`` rows; decoding runs SPMD inside the shards: no Ray call per token or
sublayer.

Every start-up failure (indivisible heads, missing checkpoint, a rank that dies or cannot be
placed) raises a clear error after removing every actor and placement group it created.

Where Ray runs: runtime/cluster.py's ``connect(address)`` (the engine then shuts down the Ray
it started). On a cluster, the package must be importable on every node (installed, or
shipped with the job's ``runtime_env``) and the model folder must exist at the same path on
every node.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import replace

import ray

from knapspec_dist.engine.generation import GenerationConfig, GenerationResult
from knapspec_dist.engine.memory import MEMORY_UTILIZATION, check_utilization, kv_memory_option
from knapspec_dist.engine.sampling import prompt_keys
from knapspec_dist.engine.scheduler import Work
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.errors import UserError, first_line
from knapspec_dist.model.tokenizer import encode, load_tokenizer
from knapspec_dist.model.weights import resolve_dtype
from knapspec_dist.profiles.profile import LatencyProfile
from knapspec_dist.runtime.accounting import job_summary
from knapspec_dist.runtime.cluster import connect, disconnect
from knapspec_dist.runtime.messages import (
    KVPages,
    KVReport,
    MeasureOptions,
    ReplicaBudget,
    ReplicaInfo,
)
from knapspec_dist.runtime.replica import (
    Replica,
    ReplicaSpec,
    StartupError,
    auto_cpus_per_rank,
    check_resources,
    node_memory,
    prepare_replicas,
    start_replicas,
    stop_replica,
)
from knapspec_dist.runtime.setup import check_kv_memory, check_setup
from knapspec_dist.speculation.options import StrategyOptions, parse_strategy

__all__ = ["RayEngine", "StartupError"]

log = logging.getLogger(__name__)


class RayEngine:
    """Replicas of TP shard actors behind one Python API (a context manager)."""

    def __init__(self, model: str, tp: int = 1, replicas: int = 1,
                 strategy: StrategyOptions | str = "knapspec", dtype: str = "fp32",
                 device: str = "cpu", address: str | None = None, *,
                 cpus_per_rank: int | None = None, reserved_cpus_per_rank: float | None = None,
                 startup_timeout_s: float = 300.0, profile_contexts: list[int] | None = None,
                 profile_repeats: int = 3, profile_need: int | None = None,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 kv_cache_memory: int | str | None = None,
                 memory_utilization: float = MEMORY_UTILIZATION, fixed_slots: bool = False):
        """``strategy``: its options, or a strategy's name with default options.
        ``cpus_per_rank`` CPUs are reserved per rank, and each rank runs that many torch
        threads (OMP_NUM_THREADS); None: the cluster's cores shared by the ranks
        (``auto_cpus_per_rank``); ``reserved_cpus_per_rank``: what Ray reserves per rank
        instead, fewer than its threads (the processor's ranks run threads on every core but
        leave the Dataset's own tasks a CPU). ``profile_contexts`` / ``profile_repeats``: the
        measurement made when no stored profile matches; ``profile_need``: the longest
        context the work will run, which a stored profile must cover and a measured one does
        (profiles/store.py). The KV cache (engine/memory.py's rule, on every rank):
        ``kv_cache_memory`` bytes per rank (or a size such as ``"2GiB"``), else
        ``memory_utilization`` of the memory free after the weights; ``max_num_seqs``: the
        cap on rows in flight (default 256 on a GPU, 16 on a CPU); ``max_model_len``: the
        longest row (prompt + new tokens), which the cache must hold (refused before any
        replica starts otherwise; default: ``profile_need``, else the model's window, and a
        row the pool cannot hold is that row's error); ``fixed_slots``: fixed slots even
        where the backend pages (a comparison's baseline)."""
        if max_num_seqs is not None and (not isinstance(max_num_seqs, int) or max_num_seqs < 1):
            raise UserError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        for name, value in (("tp", tp), ("replicas", replicas),
                            ("cpus_per_rank", 1 if cpus_per_rank is None else cpus_per_rank)):
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be an integer >= 1, got {value!r}")
        if device not in ("cpu", "cuda"):
            raise UserError(f"unknown device {device!r}; choose cpu or cuda")
        resolve_dtype(dtype)
        self.options = _options(strategy)
        path, self.config = check_setup(model, tp, self.options)

        self.path, self.tp, self.dtype, self.device = str(path), tp, dtype, device
        self.num_replicas, self.cpus_per_rank = replicas, cpus_per_rank
        self.startup_timeout_s = startup_timeout_s
        self.measure = MeasureOptions(tuple(profile_contexts) if profile_contexts else None,
                                      profile_repeats, profile_need)
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
            raise UserError(f"max_model_len must be an integer >= 1, got {max_model_len!r}")
        longest = max_model_len or profile_need
        self.budget = ReplicaBudget(row_capacity(longest, 0) if longest else None, max_num_seqs,
                                    kv_memory_option(kv_cache_memory),
                                    check_utilization(memory_utilization), max_model_len,
                                    fixed_slots)
        self.spec = ReplicaSpec(f"knapspec-{uuid.uuid4().hex[:8]}", self.path,
                                self.config.vocab_size, tp, dtype, device, cpus_per_rank or 1,
                                startup_timeout_s, reserved_cpus_per_rank)
        try:
            self.tokenizer = load_tokenizer(path)
        except UserError as e:
            log.warning("%s; text prompts are unavailable, pass token ids",
                        first_line(e))
            self.tokenizer = None
        self.last_job: dict | None = None

        self._budget_of: dict[int, ReplicaBudget] = {}  # replicas restarted smaller
        self._owns_ray = connect(address)
        self._replicas: list[Replica | None] = [None] * replicas
        try:
            if cpus_per_rank is None:
                self.cpus_per_rank = auto_cpus_per_rank(tp, replicas, device)
                self.spec = replace(self.spec, cpus_per_rank=self.cpus_per_rank)
                log.info("%d CPU(s) per rank (the cluster's cores shared by %d rank(s); "
                         "--cpus-per-rank sets it)", self.cpus_per_rank, tp * replicas)
            check_resources(self.spec, replicas)
            check_kv_memory(self.config, tp, dtype, device, self.budget, node_memory(device))
            self._replicas = start_replicas(self.spec, list(range(replicas)), self.options,
                                            self.measure, self.budget)
        except BaseException:
            self.shutdown()
            raise

    def __enter__(self) -> RayEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ replicas

    def restart_replica(self, replica: int, smaller: bool = False) -> None:
        """Kill a replica's actors and placement group, and start it again; ``smaller``
        (after out of memory): with half its KV cache and half its rows in flight
        (``KVBudget.halved``), which that replica keeps from now on."""
        self._check_replica(replica)
        kv = self.replica_info(replica).kv
        if smaller and kv is not None:
            memory, seqs = kv.halved()
            self._budget_of[replica] = replace(self._budget(replica), kv_cache_memory=memory,
                                               max_num_seqs=seqs)
        budget = self._budget(replica)
        log.warning("restarting replica %d%s", replica,
                    f" with {budget.kv_cache_memory} bytes of KV cache per rank and up to "
                    f"{budget.max_num_seqs} rows in flight" if replica in self._budget_of else "")
        stop_replica(self._replicas[replica])
        self._replicas[replica] = None
        self._replicas[replica] = start_replicas(self.spec, [replica], self.options,
                                                 self.measure, budget)[0]

    def _budget(self, replica: int) -> ReplicaBudget:
        return self._budget_of.get(replica, self.budget)

    def reconfigure(self, strategy: StrategyOptions | str) -> None:
        """Switch every replica to another strategy / options without reloading weights
        (e.g. the ``ar`` baseline, then ``knapspec``); the profile is resolved again."""
        options = _options(strategy)
        check_setup(self.path, self.tp, options)
        self.options = options
        for rep in self._replicas:  # each with its own budget (one restarted smaller keeps it)
            if rep is not None:
                prepare_replicas(self.spec, [rep], options, self.measure,
                                 self._budget(rep.index), "reconfigure")

    def shutdown(self) -> None:
        for i, rep in enumerate(getattr(self, "_replicas", [])):
            stop_replica(rep)
            self._replicas[i] = None
        if getattr(self, "_owns_ray", False):
            disconnect()
            self._owns_ray = False

    def _check_replica(self, replica: int) -> None:
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} outside 0..{self.num_replicas - 1}")

    def measure_profile(self, contexts: list[int], *, replica: int = 0, batch: int = 1,
                        max_q: int = 11, repeats: int = 5, warmup: int = 1,
                        fill: str = "random", kv: str = "fixed",
                        page: int | None = None) -> LatencyProfile:
        """A latency profile measured on one replica's shards (all ranks, MAX over ranks,
        with the all-reduce when tp > 1); see profiles/profiler.py for the method."""
        self._check_replica(replica)
        rep = self._replicas[replica]
        refs = [s.measure_profile.remote(list(contexts), repeats, batch=batch, max_q=max_q,
                                         warmup=warmup, fill=fill, kv=kv, page=page)
                for s in rep.shards]
        return LatencyProfile.from_json(ray.get(refs)[0])

    def measure_allreduce(self, sizes: list[int], *, replica: int = 0,
                          repeats: int = 5) -> list[list[float]]:
        """[[bytes, seconds], ...] of one all-reduce on a replica's process group (every rank
        takes part; rank 0's timings)."""
        self._check_replica(replica)
        refs = [s.measure_allreduce.remote(list(sizes), repeats)
                for s in self._replicas[replica].shards]
        return ray.get(refs)[0]

    def work(self, timeout_s: float = 2.0) -> Work | None:
        """What the replicas' rows have had done so far (finished or not), summed, for
        progress; None when a replica does not answer within ``timeout_s``."""
        refs = [rep.coordinator.work.remote() for rep in self._replicas
                if rep is not None and rep.coordinator is not None]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            return None
        try:
            return sum(ray.get(ready), Work())
        except ray.exceptions.RayError:  # a dead replica: the dispatcher will notice
            return None

    def live_infos(self, timeout_s: float = 2.0) -> list[ReplicaInfo] | None:
        """Every running replica's state now (its KV cache's use so far included); None when
        one does not answer within ``timeout_s``."""
        refs = [rep.coordinator.info.remote() for rep in self._replicas
                if rep is not None and rep.coordinator is not None]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            return None
        try:
            return ray.get(refs)
        except ray.exceptions.RayError:  # a dead replica: the dispatcher will notice
            return None

    def kv_report(self, timeout_s: float = 2.0) -> KVReport | None:
        """The replicas' KV cache and its use so far (None: not known right now)."""
        infos = self.live_infos(timeout_s)
        return KVReport.of(infos) if infos is not None else None

    def kv_pages(self, replica: int = 0) -> list[KVPages]:
        """Each rank's pages now, in rank order (a leak check: all free once no row runs)."""
        self._check_replica(replica)
        return ray.get([s.kv_pages.remote() for s in self._replicas[replica].shards])

    def replica_info(self, replica: int) -> ReplicaInfo:
        """What the replica's coordinator reported when prepared (empty while it is not)."""
        rep = self._replicas[replica]
        return rep.info if rep and rep.info else ReplicaInfo(replica)

    # ------------------------------------------------------------------ requests

    def submit(self, replica: int, prompt_ids: list[int], config: GenerationConfig,
               key: object = None):
        """An ObjectRef resolving to the GenerationResult (text filled) of one prompt.
        ``key`` names the row for its sampling seed (a job's row id); None: the prompt."""
        self._check_replica(replica)
        rep = self._replicas[replica]
        if rep is None or rep.coordinator is None:
            raise RuntimeError(f"replica {replica} is not running (restart_replica)")
        return rep.coordinator.generate.remote(list(prompt_ids), config, key)

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError(f"{self.path}: no tokenizer; pass prompts as token ids")
            return encode(self.tokenizer, prompt, chat)
        return list(prompt)

    def generate(self, prompts: list[str] | list[list[int]], config: GenerationConfig | None = None,
                 chat: bool = False, *, max_new_tokens: int | None = None,
                 stop_at_eos: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None) -> list[GenerationResult]:
        """Generate for every prompt, spread round-robin over the replicas; results in input
        order. The keyword arguments given override ``config``'s. Raises the first failed
        prompt's error."""
        config = config or GenerationConfig()
        given = {"max_new_tokens": max_new_tokens, "stop_at_eos": stop_at_eos,
                 "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        if any(v is not None for v in given.values()):
            current = {"max_new_tokens": config.max_new_tokens,
                       "stop_at_eos": config.stop_at_eos,
                       "temperature": config.sampling.temperature, "top_k": config.sampling.top_k,
                       "top_p": config.sampling.top_p, "seed": config.sampling.seed}
            config = GenerationConfig.of(**{k: current[k] if v is None else v
                                            for k, v in given.items()},
                                         sampling=config.sampling.method,
                                         max_num_batched_tokens=config.max_num_batched_tokens)
        ids = [self.encode(p, chat) for p in prompts]
        start = time.perf_counter()
        refs = [self.submit(i % self.num_replicas, p, config, key)
                for i, (p, key) in enumerate(zip(ids, prompt_keys(ids)))]
        results = ray.get(refs)
        self.last_job = job_summary(results, time.perf_counter() - start, self.num_replicas)
        return results


def _options(strategy: StrategyOptions | str) -> StrategyOptions:
    """A strategy's name (``knapspec:paper``) means that strategy with its default options."""
    return parse_strategy(strategy).options if isinstance(strategy, str) else strategy
