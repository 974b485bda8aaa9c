"""Helpers the batching tests share (test_scheduler, test_generate, test_paged,
test_paged_flex, test_kv_budget): the strategies a batch runs, a model with another EOS id,
and the page pool's invariants checked while a scheduler runs."""

from __future__ import annotations

import copy
from dataclasses import replace

from knapspec_dist.engine.scheduler import Scheduler
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.model.paged_cache import SCRATCH
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.knapspec import KnapSpecConfig, KnapSpecSelector
from knapspec_dist.speculation.selfspec import SelfSpeculative, StaticSelector

from conftest import random_prompt

STRATEGIES = {
    "ar": lambda profile: Autoregressive(),
    "static": lambda profile: SelfSpeculative(StaticSelector(frozenset({2, 5, 7}), 3), 0.3),
    "knapspec": lambda profile: SelfSpeculative(
        KnapSpecSelector(profile, KnapSpecConfig(interval=8)), tau_conf=0.0, name="knapspec"),
}


def mixed_prompts(vocab: int, lengths=(9, 70, 23, 140, 4, 51, 33), seed: int = 500
                  ) -> list[list[int]]:
    """Random prompts of mixed lengths (one per length, seeded by it)."""
    return [random_prompt(n, vocab, seed=seed + n) for n in lengths]


def with_eos(model, token: int):
    """The same weights, with ``token`` as the model's EOS id."""
    m = copy.copy(model)
    m.cfg = replace(model.cfg, eos_token_ids=(token,))
    return m


def check_pool(sched: Scheduler) -> None:
    """The pool's invariants: every page either free or held by exactly one live row, free
    rows on the scratch page only, each live row holding its whole reservation."""
    b = sched.batch
    pool, cache = b.pool, b.cache
    held = [p for pages in cache.pages for p in pages]
    assert len(held) == len(set(held)), "a page in two rows"
    assert SCRATCH not in held and SCRATCH not in pool.free
    assert set(held).isdisjoint(pool.free) and pool.free == sorted(set(pool.free))
    assert len(held) + len(pool.free) == pool.total == cache.n_pages - 1
    live = dict(enumerate(b.rows))
    if b.prefilling is not None:
        live[b.size] = b.prefilling
    for slot in range(cache.batch):
        table = cache.table[slot].tolist()
        if slot not in live:
            assert not cache.pages[slot] and cache.lengths[slot] == 0
            assert set(table) == {SCRATCH}
            continue
        row, pages = live[slot], cache.pages[slot]
        assert cache.consecutive[slot] == (pages == list(range(pages[0], pages[0] + len(pages))))
        assert len(pages) == pool.pages_for(row_capacity(len(row.prompt), row.limit))
        assert table[:len(pages)] == pages and set(table[len(pages):]) <= {SCRATCH}
        assert cache.lengths[slot] <= cache.reserved(slot)
    assert sum(cache.reserved(s) for s in live) <= pool.tokens


def run_rows(sched: Scheduler, ps: list[list[int]], checked: bool = False):
    """Every prompt through ``sched`` (row ids in order), the pool checked after each step
    when ``checked``; the finished rows in input order."""
    for rid, p in enumerate(ps):
        sched.add(rid, p)
    done = {}
    while sched.busy:
        for row in sched.step():
            done[row.rid] = row
        if checked:
            check_pool(sched)
    return [done[i] for i in range(len(ps))]
