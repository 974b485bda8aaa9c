"""A stub engine for the job layer's benchmarks and tests: every row "generates" for a fixed
delay, ``max_num_seqs`` rows at a time per replica, and costs no model.

Injected like tests/faults.py injects a shard class: ``run_job(config,
engine_factory=StubEngines(delay), backend_factory=StubBackend)``. What is left to measure
is the job layer itself: streaming the input, dispatch, writing parts, progress.
"""

from __future__ import annotations

import heapq
import time

from knapspec_dist.engine.generation import GenerationResult, GenerationStats
from knapspec_dist.engine.scheduler import Work
from knapspec_dist.runtime.messages import ReplicaInfo


class StubEngines:
    """engine_factory: replicas that answer each row ``delay`` seconds after it started."""

    def __init__(self, delay: float = 0.05, max_num_seqs: int = 64):
        self.delay, self.max_num_seqs = delay, max_num_seqs
        self.num_replicas = 0

    def __call__(self, config, strategy, replicas):
        self.num_replicas = replicas
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def replica_info(self, replica: int) -> ReplicaInfo:
        return ReplicaInfo(replica, max_num_seqs=self.max_num_seqs)


class StubBackend:
    """runtime.dispatch.Backend over :class:`StubEngines`: a row admitted when its replica has a
    free slot, finished ``delay`` seconds later (continuous batching, no model)."""

    def __init__(self, engine: StubEngines):
        self.engine = engine
        self.num_replicas = engine.num_replicas
        self.ready: list[tuple[float, int]] = []  # (finish time, handle)
        self.rows: dict[int, tuple[int, float, int]] = {}  # handle -> prompt len, start, rep
        self.next = 0
        self.emitted = 0

    def submit(self, replica, prompt_ids, config, key=None):
        h, now = self.next, time.time()
        self.next += 1
        self.rows[h] = (len(prompt_ids), now, config.max_new_tokens)
        heapq.heappush(self.ready, (now + self.engine.delay, h))
        return h

    def wait(self, handles, timeout):
        now = time.time()
        if self.ready and self.ready[0][0] > now:
            time.sleep(min(timeout, self.ready[0][0] - now))
        now, out = time.time(), []
        while self.ready and self.ready[0][0] <= now:
            out.append(heapq.heappop(self.ready)[1])
        return out

    def result(self, h):
        n_prompt, start, n = self.rows.pop(h)
        end = time.time()
        self.emitted += n
        stats = GenerationStats(prompt_tokens=n_prompt, new_tokens=n, rounds=n, wall_s=end - start,
                                admitted_at=start, finished_at=end, prefill_s=0.0)
        return GenerationResult(list(range(1, n + 1)), stats, "length", text="stub")

    def work(self):
        return Work(emitted=self.emitted)

    def restart(self, replica, smaller=False):
        pass

    def is_replica_failure(self, exc):
        return False
