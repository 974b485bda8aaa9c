"""The coordinator actor of one replica: it resolves the latency profile and orders requests.

* Profiles: resolved by profiles/store.py's ``lookup`` for the replica's devices, model
  shape, dtype, tp, mode and KV layout (the cache is planned first, so a paged replica is
  priced by a profile measured over pages, or where it may borrow, by this device's over fixed
  slots): the one the user named, or the stored one that covers the job's longest context
  (``profiles/``, then the profile cache). When none matches, a strategy that refits its
  prices online (knapspec, unless ``fixed`` or ``paper``) starts at once from a
  starting point (this machine's last online refit, else another device's profile of the
  same model), said in the log; any other has the shards measure one (all ranks, MAX over
  ranks, the all-reduce included), awaited without blocking this actor's loop, and keeps it
  in the profile cache for later jobs and the other replicas (the engine's start-up wait
  does not count that measurement against its timeout: ``measuring_since``). A replica whose
  ranks report different devices never matches a stored profile and is measured (priced at
  its slowest rank). The profile (and those at other batch sizes beside it) goes to the
  shards, whose selectors price with it; this actor keeps its description.
* Memory: every rank plans its KV cache from its own free memory (engine/memory.py); this
  actor gives all of them the smallest plan, so they hold the same pool and make the same
  page decisions, with no page traffic between them.
* Requests: continuously batched. Requests queue here; a driver task admits them into the
  shards' schedulers (engine/scheduler.py) as slots free up, up to ``max_num_seqs`` rows at
  once (the schedulers then start them as their KV pages allow), with one Ray call per
  batch of rounds that every rank receives in the same order (SPMD), never one per token.
  A dead shard fails every row of the replica with its RayActorError; the engine restarts
  the replica and the job retries those rows.

An async actor: awaiting the shards leaves it free to queue the requests that arrive meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, replace

import ray

from knapspec_dist.engine.memory import KVBudget
from knapspec_dist.engine.pages import KVUse
from knapspec_dist.engine.scheduler import Work
from knapspec_dist.errors import UserError, first_line
from knapspec_dist.model.config import load_config
from knapspec_dist.model.tokenizer import load_tokenizer
from knapspec_dist.profiles.profile import LatencyProfile
from knapspec_dist.profiles.store import (
    ProfileChoice,
    adopt,
    contexts_for,
    decode_mode,
    lookup,
)
from knapspec_dist.runtime.messages import (
    Admission,
    MeasureOptions,
    Measuring,
    ReplicaBudget,
    ReplicaInfo,
    ShardInfo,
    StepResult,
)
from knapspec_dist.runtime.setup import check_kv, describe_kv
from knapspec_dist.speculation.options import StrategyOptions

log = logging.getLogger(__name__)

ROUNDS_PER_CALL = 16  # scheduler steps per shard call at most (a row finishing ends it)
CALL_SECONDS = 1.0  # ... and about this long: steps of long prefill chunks are fewer per call


@dataclass
class PendingRequest:
    """A prompt queued here until a slot frees; ``future`` resolves to its result."""

    rid: int
    prompt_ids: list[int]
    config: object  # its GenerationConfig: rows of one config share a batch
    future: asyncio.Future
    key: object  # names the row for its sampling seed

    def admission(self) -> Admission:
        return Admission(self.rid, tuple(self.prompt_ids), self.key)


async def _awaitable(ref):
    return await ref


def calibrates(options: StrategyOptions) -> bool:
    """Whether the strategy refits its prices from its timed rounds (speculation/factory.py's rule:
    knapspec, unless ``fixed`` or ``paper``), so it may start from a borrowed profile."""
    if options.name != "knapspec":
        return False
    return options.calibrate if options.calibrate is not None else not options.paper


def _kind(e: BaseException) -> str:
    """The original error's class (Ray builds a new RayTaskError(...) class per instance)."""
    return type(getattr(e, "cause", None) or e).__name__


class Coordinator:
    def __init__(self, replica: int, model_path: str, vocab_size: int, tp: int, dtype: str):
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.replica, self.path, self.vocab, self.tp, self.dtype = (replica, model_path,
                                                                     vocab_size, tp, dtype)
        self.shards: list = []
        self.profile_description: dict | None = None  # key, path, origin (info)
        self.measuring: Measuring | None = None  # a profile measurement under way
        self._queue: deque[PendingRequest] = deque()  # not yet admitted
        self._active: dict[int, asyncio.Future] = {}  # admitted to the shards, not finished
        self._ray: dict[int, float] = {}  # each active row's share of Ray round trips
        self._next_id = 0
        self._seed = random.getrandbits(63)
        self._driver: asyncio.Task | None = None
        self.max_num_seqs = 1
        self._tokenizer = None
        self._tokenizer_tried = False
        self.served = 0
        self.done_work = Work()  # by every row, finished or not: the job's live progress
        self.kv: KVBudget | None = None  # the KV cache every rank holds, once prepared
        self.use = KVUse()  # how the rows used it so far
        self.grace_s = 10.0  # how long other ranks may take to fail like the first one
        self.stopping = False  # the engine said it kills this replica (stop)

    # ------------------------------------------------------------------ startup

    async def prepare(self, shards: list, options: StrategyOptions, infos: list[ShardInfo],
                      measure: MeasureOptions, budget: ReplicaBudget) -> ReplicaInfo:
        """Resolve the profile (KnapSpec / CLaSp), then configure every shard's strategy with
        it: the shards' selectors price with it, this actor keeps only its description."""
        self.shards = shards
        self.profile_description = None
        self._decode([])  # load the tokenizer now, not on the first request
        plans = await asyncio.gather(*[s.plan_memory.remote(budget) for s in shards])
        kv = KVBudget.least(plans)  # every rank holds the same cache, decides the same
        check_kv(kv, budget)  # the start-up wait names the replica
        profiles = None
        if options.name in ("knapspec", "clasp"):  # priced over the layout it decodes over
            choice = await self._find(options, infos, measure, "paged" if kv.paged else "fixed")
            self.profile_description = choice.describe()
            if choice.profile.tp != self.tp:
                log.warning("replica %d: profile %s was measured at tp=%d, this replica runs "
                            "tp=%d: its all-reduce costs do not match", self.replica,
                            choice.path, choice.profile.tp, self.tp)
            profiles = [p.to_json() for p in choice.profiles]
        await asyncio.gather(*[s.configure.remote(replace(options, profile=None), profiles, kv)
                               for s in shards])
        self.kv, self.max_num_seqs = kv, kv.max_num_seqs
        log.info("replica %d: KV cache of %s per rank, up to %d rows in flight", self.replica,
                 describe_kv(kv), self.max_num_seqs)
        return self.info()

    async def _find(self, options: StrategyOptions, infos: list[ShardInfo],
                    measure: MeasureOptions, kv: str) -> ProfileChoice:
        """profiles/store.py's lookup for this replica's devices and KV layout ``kv`` (files
        only, in a thread); where a strategy refits its prices online, a starting point rather
        than a measurement; else the shards measure one over ``kv``, awaited, never blocking
        this loop."""
        config = load_config(self.path)
        devices = [i.device for i in infos]
        need = measure.need
        choice = await asyncio.to_thread(lookup, options.profile, devices, config.shape(),
                                         self.dtype, tp=self.tp, need=need,
                                         borrow=calibrates(options), kv=kv)
        if choice is not None:
            return choice
        contexts = list(measure.contexts or contexts_for(need, config.max_position_embeddings))
        profile = await self._measure(contexts, decode_mode(devices[0]), measure.repeats, kv)
        return await asyncio.to_thread(adopt, profile)

    async def _measure(self, contexts: list[int], mode: str, repeats: int,
                       kv: str = "fixed") -> LatencyProfile:
        """A profile measured by every shard (samples MAX-reduced over the ranks)."""
        start = time.perf_counter()
        self.measuring = Measuring(tuple(contexts), repeats, time.time())
        try:
            outs = await asyncio.gather(*[s.measure_profile.remote(list(contexts), repeats,
                                                                   mode=mode, kv=kv)
                                          for s in self.shards])
        finally:
            self.measuring = None
        profile = LatencyProfile.from_json(outs[0])
        log.info("replica %d: measured profile %s (contexts %s) in %.0fs", self.replica,
                 profile.key(), list(contexts), time.perf_counter() - start)
        return profile

    def measuring_since(self) -> Measuring | None:
        """The measurement under way, or None: what the engine's start-up wait does not
        count against its timeout."""
        return self.measuring

    def stop(self) -> None:
        """The engine is about to kill this replica's actors (a restart, the job's end): the
        ranks' failures that follow are its doing, not an error to report."""
        self.stopping = True

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt_ids: list[int], config, key: object = None):
        """One prompt, decoded in this replica's continuous batch; rank 0's result, with text,
        replica and its share of the Ray time. ``key`` names the row for its sampling seed
        (engine/sampling.py); None: the prompt itself."""
        ids = list(prompt_ids)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab]
        if bad:  # a vocab-parallel embedding would silently embed these as zeros
            raise UserError(f"prompt has token ids outside the vocabulary 0..{self.vocab - 1}: "
                            f"{bad[:5]}")
        self._next_id += 1
        if not config.sampling.greedy and config.sampling.seed is None:
            # every rank must draw the same samples: one seed for the whole replica (the same
            # for every request, so requests of one job share a batch), rows told apart here
            config = replace(config, sampling=replace(config.sampling, seed=self._seed))
            key = ("unseeded", self._next_id)
        future = asyncio.get_running_loop().create_future()
        self._queue.append(PendingRequest(self._next_id, ids, config, future,
                                          tuple(ids) if key is None else key))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())
        result = await future
        result.replica = self.replica
        result.text = self._decode(result.token_ids)
        self.served += 1
        return result

    async def _drive(self) -> None:
        """Feed the shards' schedulers: each call admits queued rows into free slots (rows of
        one generation config at a time) and returns when a row finishes or after
        ``ROUNDS_PER_CALL`` rounds, so a freed slot is refilled within one Ray round trip.
        Rounds per call shrink so that a call lasts about ``CALL_SECONDS`` (the live token
        count, i.e. the job's progress, moves at least that often); the coordinator decides
        it, so every rank runs the same steps."""
        config, rounds = None, 1
        while self._queue or self._active:
            if not self._active:
                config = self._queue[0].config
            admit: list[PendingRequest] = []
            while (self._queue and self._queue[0].config == config
                   and len(self._active) + len(admit) < self.max_num_seqs):
                admit.append(self._queue.popleft())
            for request in admit:
                self._active[request.rid] = request.future
            start = time.perf_counter()
            rows = [request.admission() for request in admit]
            refs = [s.advance.remote(config, rows, rounds, self.max_num_seqs) for s in self.shards]
            try:
                outs = await self._gather(refs)
            except BaseException as e:  # a dead or failing shard: every row here fails with it
                for future in list(self._active.values()) + [q.future for q in self._queue]:
                    if not future.done():
                        future.set_exception(e)
                self._active.clear()
                self._queue.clear()
                return
            first: StepResult = outs[0]
            finished, refused = first.finished, first.refused
            self.done_work += first.work
            self.use = self.use.merge(first.use)
            if first.steps and first.elapsed_s > 0:  # the next call's rounds, from its s/step
                rounds = max(1, min(ROUNDS_PER_CALL,
                                    int(CALL_SECONDS * first.steps / first.elapsed_s)))
            if not first.busy and len(finished) + len(refused) < len(self._active):
                lost = RuntimeError(f"replica {self.replica}: the shards dropped rows")
                for rid, future in self._active.items():
                    if rid not in {r for r, _ in finished} | {r for r, _ in refused}:
                        future.set_exception(lost)
            ray_share = max(0.0, time.perf_counter() - start - max(o.elapsed_s for o in outs))
            for rid in self._active:
                self._ray[rid] = self._ray.get(rid, 0.0) + ray_share / len(self._active)
            for rank, other in enumerate(outs[1:], 1):
                if [r.token_ids for _, r in other.finished] != [r.token_ids for _, r in finished]:
                    error = RuntimeError(f"replica {self.replica}: rank {rank} generated "
                                         f"different tokens than rank 0 (ranks out of sync)")
                    for future in self._active.values():
                        future.set_exception(error)
                    self._active.clear()
                    break
            for rid, message in refused:
                future = self._active.pop(rid, None)
                self._ray.pop(rid, None)
                if future is not None and not future.done():
                    future.set_exception(UserError(message))
            for rid, result in finished:
                future = self._active.pop(rid, None)
                result.stats.split.ray_s += self._ray.pop(rid, 0.0)
                if future is not None and not future.done():
                    future.set_result(result)

    async def _gather(self, refs: list) -> list:
        """Every rank's result. If a rank fails, the others get a moment to fail the same way
        (a bad prompt fails on every rank before any collective); if they do not, the ranks
        are out of step (some may wait in a collective forever), so the replica's shards are
        killed: later requests then fail with RayActorError and the replica is restarted."""
        tasks = [asyncio.ensure_future(_awaitable(r)) for r in refs]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if not failed:
            return [t.result() for t in tasks]
        if pending:
            more, pending = await asyncio.wait(pending, timeout=self.grace_s)
            done |= more
        errors = [t.exception() for t in tasks if t.done() and t.exception() is not None]
        consistent = not pending and len(errors) == len(tasks) and \
            len({_kind(e) for e in errors}) == 1 and \
            not isinstance(errors[0], ray.exceptions.RayActorError)
        if not consistent:
            log.log(logging.DEBUG if self.stopping else logging.ERROR,
                    "replica %d: ranks failed inconsistently (%s); killing its shards",
                    self.replica, errors[0])
            for shard in self.shards:
                try:
                    ray.kill(shard, no_restart=True)
                except Exception:  # already dead
                    pass
        raise errors[0]

    def _decode(self, ids: list[int]) -> str:
        if not self._tokenizer_tried:
            self._tokenizer_tried = True
            try:
                self._tokenizer = load_tokenizer(self.path)
            except Exception as e:  # a checkpoint without tokenizer: results keep token ids
                log.warning("replica %d: no tokenizer (%s); results carry token ids only",
                            self.replica, first_line(e))
        if self._tokenizer is None:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def work(self) -> Work:
        """What this replica's rows have had done so far, finished or not."""
        return self.done_work

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(self.replica, self.served, self.max_num_seqs,
                           self.profile_description, self.kv, self.use, self.done_work)
