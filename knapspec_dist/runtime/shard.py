"""A shard actor: one tensor-parallel rank of one replica.

Each rank loads only its slice of the weights, joins the replica's torch.distributed group
(gloo on CPU, NCCL on CUDA) and runs the strategy SPMD: every rank receives the same request
(one Ray call per prompt, never per token or sublayer) and executes identical forwards; the
collectives inside the model keep the ranks in lock step, and rank 0 broadcasts each round's
draft plan (``speculation.spmd.SyncedSelector``). The class is plain Python; ``ray.remote`` is
applied by the engine.
"""

from __future__ import annotations

import copy
import logging
import os
import time

import ray
import torch
import torch.distributed as dist

from knapspec_dist.engine.generation import Split
from knapspec_dist.engine.memory import (
    KVBudget,
    free_bytes,
    kv_bytes_per_token,
    plan_kv,
)
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.pages import KVUse, page_size
from knapspec_dist.engine.scheduler import Scheduler, result
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.errors import UserError
from knapspec_dist.model.attention import attention_backend
from knapspec_dist.model.paged_cache import PagedKVCache
from knapspec_dist.model.weights import resolve_dtype
from knapspec_dist.parallel import (
    free_port,
    init_distributed,
    load_sharded,
    parameter_bytes,
)
from knapspec_dist.profiles import profiler
from knapspec_dist.profiles.allreduce import measure_allreduce
from knapspec_dist.profiles.device import device_info
from knapspec_dist.profiles.profile import LatencyProfile
from knapspec_dist.runtime.accounting import Meter, split
from knapspec_dist.runtime.messages import (
    Admission,
    KVPages,
    ReplicaBudget,
    ShardInfo,
    StepResult,
)
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.speculation.options import StrategyOptions
from knapspec_dist.speculation.spmd import spmd_strategy

log = logging.getLogger(__name__)


class Shard:
    def __init__(self, replica: int, rank: int, world: int, threads: int, device: str):
        self.replica, self.rank, self.world, self.device = replica, rank, world, device
        torch.set_num_threads(max(1, threads))
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.model = self.strategy = self.meter = self.scheduler = self.kv = None
        self.runner = None
        self._planned: tuple[ReplicaBudget, KVBudget] | None = None

    # ------------------------------------------------------------------ startup

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: this node's address and a free port for the process group."""
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, path: str, address: str, port: int, dtype: str) -> ShardInfo:
        """Join the group and load this rank's shard; returns what the coordinator needs."""
        start = time.perf_counter()
        if self.world > 1:
            init_distributed(self.rank, self.world, address, port, device=self.device)
        self.model = load_sharded(path, self.rank, self.world, dtype=resolve_dtype(dtype),
                                  device=self.device, timed=self.device == "cpu")
        self.runner = ModelRunner(self.model)  # its cache and graphs outlive each scheduler
        self.meter = Meter()
        self.meter.install(self.model)
        log.info("replica %d rank %d/%d loaded %.0f MiB of weights in %.1fs", self.replica,
                 self.rank, self.world, parameter_bytes(self.model) / 2 ** 20,
                 time.perf_counter() - start)
        return ShardInfo(self.rank, parameter_bytes(self.model), device_info(self.model.device),
                         os.getpid())

    def measure_profile(self, contexts: list[int], repeats: int, *, batch: int = 1,
                        max_q: int = profiler.DEFAULT_MAX_Q, warmup: int = 1,
                        fill: str = "random", mode: str = "eager", kv: str = "fixed",
                        page: int | None = None) -> dict:
        """Measure a latency profile (collective: every rank of the replica calls it); the
        arguments are profiler.measure's."""
        group = dist.group.WORLD if self.world > 1 else None
        profile = profiler.measure(self.model, contexts, batch=batch, max_q=max_q,
                                   repeats=repeats, warmup=warmup, fill=fill, group=group,
                                   shape=self.model.cfg.shape(), mode=mode, kv=kv, page=page)
        return profile.to_json()

    def measure_allreduce(self, sizes: list[int], repeats: int = 5) -> list[list[float]]:
        """[[bytes, seconds], ...] of one all-reduce on this replica's group (collective)."""
        if self.world == 1:
            return [[float(b), 0.0] for b in sizes]
        return measure_allreduce(dist.group.WORLD, sizes, dtype=self.model.dtype,
                                 repeats=repeats)

    def free_memory(self) -> int:
        """Bytes free on this rank's device now (engine/memory.py's ``free_bytes``)."""
        return free_bytes(self.model.device)

    def plan_memory(self, budget: ReplicaBudget) -> KVBudget:
        """This rank's KV cache by engine/memory.py's rule, from its memory free now that its
        weights are loaded (the same request planned again, on a reconfigure, gets the same
        answer: the cache it already holds is not free memory)."""
        if self._planned is not None and self._planned[0] == budget:
            return self._planned[1]
        model = self.model
        capacity = budget.capacity or row_capacity(model.cfg.max_position_embeddings, 0)
        free = self.free_memory()
        page = page_size(attention_backend(model))
        kv = plan_kv(per_token=kv_bytes_per_token(model), free=free, capacity=capacity,
                     paged=not budget.fixed_slots, cuda=model.device.type == "cuda", page=page,
                     kv_cache_memory=budget.kv_cache_memory,
                     memory_utilization=budget.memory_utilization,
                     max_num_seqs=budget.max_num_seqs)
        if budget.kv_cache_memory is not None and budget.kv_cache_memory > free:
            log.warning("replica %d rank %d: --kv-cache-memory %d bytes is more than the %d "
                        "free next to the weights", self.replica, self.rank,
                        budget.kv_cache_memory, free)
        self._planned = (budget, kv)
        return kv

    def configure(self, options: StrategyOptions, profiles: list[dict] | None,
                  kv: KVBudget) -> None:
        """Build the strategy (same on every rank), priced by ``profiles``: the JSON of the
        coordinator's profile and of those at other batch sizes (None for ar and static).
        ``kv``: the cache every rank of the replica holds (the smallest of their plans)."""
        self.kv = kv
        self.scheduler = None
        priced = None if profiles is None else [LatencyProfile.from_json(p) for p in profiles]
        strategy = spmd_strategy(build_strategy(options, self.model, priced), self.model)
        if getattr(strategy, "selector", None) is not None:
            self.meter.wrap(strategy.selector, "plan")  # the DP counts as compute
        self.strategy = strategy

    def kv_pages(self) -> KVPages:
        """This rank's cache now: pages (fixed: slots) in all and those no row holds."""
        cache = self.runner.cache
        if cache is None:
            total = self.kv.pages if self.kv is not None else 0
            return KVPages(self.rank, total, total)
        if isinstance(cache, PagedKVCache):
            total = cache.n_pages - 1
            return KVPages(self.rank, total, total - sum(len(p) for p in cache.pages))
        return KVPages(self.rank, cache.batch, sum(n == 0 for n in cache.lengths))

    # ------------------------------------------------------------------ requests

    def advance(self, config, admit: list[Admission], max_rounds: int,
             max_num_seqs: int) -> StepResult:
        """Continuous batching, SPMD on every rank: queue the ``admit`` rows, then run
        scheduler steps until a row finishes or ``max_rounds`` have run. A row's time split is
        its share of each call it took part in (the call's split divided among its rows), so
        the rows of a job add up to the replica's time."""
        if self.strategy is None:
            raise RuntimeError("shard not configured")
        if self.scheduler is None or (self.scheduler.config != config and not self.scheduler.busy):
            kv = self.kv
            self.scheduler = Scheduler(self.strategy, self.model, config,
                                       min(max_num_seqs, kv.max_num_seqs), kv.capacity,
                                       runner=self.runner, paging=kv.paging())
            self.shares: dict[int, Split] = {}  # per row: its share of the calls so far
        sched = self.scheduler
        sched.use = KVUse()  # this call's peaks and waits
        refused = []
        for row in admit:
            try:
                sched.add(row.rid, list(row.prompt_ids), row.key)
                self.shares[row.rid] = Split()
            except UserError as e:
                refused.append((row.rid, str(e)))
        comm = self.model.tp.comm
        comm.reset()
        self.meter.seconds = 0.0
        start = time.perf_counter()
        finished = []
        before, steps = copy.copy(sched.work), 0
        try:
            for _ in range(max_rounds):
                if not sched.busy:
                    break
                steps += 1
                finished += sched.step()
                if finished:
                    break
        except BaseException:  # its rows fail with it: the next call starts from an empty cache
            self.scheduler = None
            self.runner.empty_cache()
            raise
        elapsed = time.perf_counter() - start
        parts = split(elapsed, self.meter.seconds, comm.seconds, comm.calls)
        for share in self.shares.values():  # rows waiting, prefilling, decoding or just done
            share.add(parts, len(self.shares))
        out = []
        for row in finished:
            r = result(row)
            r.stats.split = self.shares.pop(row.rid)
            out.append((row.rid, r))
        return StepResult(out, refused, elapsed, sched.busy, sched.work - before, steps,
                          sched.use)
