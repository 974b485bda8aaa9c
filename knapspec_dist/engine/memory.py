"""How much KV cache a replica's rank holds, and so how many rows decode at once: the one
rule every layer asks (``plan_kv``), from the model's bytes per position, the rank's free
memory and the user's options.

The budget: ``--kv-cache-memory`` bytes per rank when given, else ``--memory-utilization``
(default 0.9, vLLM's ``--gpu-memory-utilization``) of what the device reports free once the
weights are loaded (CUDA: ``torch.cuda.mem_get_info``; CPU: half the available RAM, the rest
being the process's working memory and the page cache). Bytes per position:
2 x layers x local KV heads x head_dim x dtype bytes (``kv_bytes_per_token``).

- Paged (the default, on every backend): the budget is one pool of pages and the scratch
  page (engine/pages.py's ``page_size``: 16 positions under sdpa, one 128-position flex key
  block under flex), never more than the row cap could fill at full length
  (``max_num_seqs`` x one row's pages), and rows are admitted as the free pages cover them;
  ``--max-num-seqs`` is only a cap on the rows in flight (default 256 on a GPU, vLLM's, and
  16 on a CPU, where a step is compute-bound and larger batches add latency without
  throughput).
- Fixed slots (``fixed_slots``: the comparison the benchmarks and the profiler make): the
  budget is cut into slots of one row's ``capacity`` positions, at most the cap of them.

A budget that holds no row of ``--max-model-len`` is refused before any replica starts
(runtime/setup.py, from the model config: ``kv_bytes_per_token_of``); under TP every rank
plans its own and the coordinator gives all of them the smallest (``KVBudget.least``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import psutil
import torch

from knapspec_dist.engine.model_runner import CAPACITY_STEP, MIN_CAPACITY
from knapspec_dist.engine.pages import CPU_PAGE, FLEX_PAGE, Paging, page_size
from knapspec_dist.model.attention import attention_backend
from knapspec_dist.option_rules import check, format_size

GPU_CAP, CPU_CAP = 256, 16
MEMORY_UTILIZATION = 0.9  # of the free memory: activations, logits and the allocator's slack


@dataclass(frozen=True)
class KVBudget:
    """One rank's KV cache as planned: ``pages`` pages of ``page`` positions (paged; the
    scratch page aside), or ``pages`` slots of ``page`` positions (fixed slots: one row
    each), ``per_token`` bytes a position; at most ``max_num_seqs`` rows in flight, each of
    at most ``capacity`` positions."""

    paged: bool
    page: int
    pages: int
    per_token: int
    max_num_seqs: int
    capacity: int

    @property
    def tokens(self) -> int:
        """Positions the rows may hold together."""
        return self.pages * self.page

    @property
    def bytes(self) -> int:
        """Bytes the cache takes on the rank (a paged cache's scratch page included): never
        more than the budget it was planned from."""
        return (self.pages + self.paged) * self.page * self.per_token

    def budget_for(self, tokens: int) -> int:
        """Bytes a budget needs for a pool of ``tokens`` positions (the scratch page too)."""
        return (tokens + self.paged * self.page) * self.per_token

    def row_tokens(self, tokens: int) -> int:
        """Positions of the pool a row of ``tokens`` positions takes (whole pages or a slot)."""
        return -(-tokens // self.page) * self.page if self.paged else self.page

    def holds(self, tokens: int) -> bool:
        """Whether the empty cache holds one row of ``tokens`` positions."""
        return tokens <= self.capacity and self.row_tokens(tokens) <= self.tokens

    def paging(self) -> Paging | None:
        """The scheduler's paged cache (None: fixed slots)."""
        return Paging(self.tokens, self.page) if self.paged else None

    @staticmethod
    def least(budgets: list[KVBudget]) -> KVBudget:
        """What every rank of a replica can hold: the smallest pool and row cap (the ranks
        then make the same admissions with no page traffic between them)."""
        first = budgets[0]
        return replace(first, pages=min(b.pages for b in budgets),
                       max_num_seqs=min(b.max_num_seqs for b in budgets))

    def halved(self) -> tuple[int, int]:
        """After out of memory: (bytes per rank, max_num_seqs) of half this budget, still
        holding one row of ``capacity`` positions and one row in flight."""
        one_row = self.budget_for(self.row_tokens(self.capacity))
        half = self.budget_for(self.tokens // 2 // self.page * self.page if self.paged
                               else self.tokens // 2)
        return max(one_row, half), max(1, self.max_num_seqs // 2)


def slot_size(capacity: int) -> int:
    """Positions of one fixed slot of ``capacity`` positions, as model_runner rounds it."""
    return -(-max(capacity, MIN_CAPACITY) // CAPACITY_STEP) * CAPACITY_STEP


def positions_that_fit(free: int, per_token: int,
                       memory_utilization: float = MEMORY_UTILIZATION) -> int:
    """Cache positions (all rows together) that ``memory_utilization`` of ``free`` bytes hold."""
    return int(memory_utilization * free) // max(1, per_token)


def plan_kv(*, per_token: int, free: int, capacity: int, paged: bool, cuda: bool,
            kv_cache_memory: int | None = None,
            memory_utilization: float = MEMORY_UTILIZATION,
            max_num_seqs: int | None = None, page: int | None = None) -> KVBudget:
    """The rule of the module docstring. ``free``: the rank's free bytes (unused when
    ``kv_cache_memory`` is given); ``capacity``: positions one row may need. A budget too
    small for one row gives 0 pages (the caller refuses it). A paged cache's scratch page
    (engine/pages.py) is part of the budget: the cache never takes more bytes than asked."""
    budget = kv_cache_memory if kv_cache_memory is not None else int(memory_utilization * free)
    cap = max_num_seqs or (GPU_CAP if cuda else CPU_CAP)
    if paged:
        page = page or (FLEX_PAGE if cuda else CPU_PAGE)
        pages = min(max(0, budget // (per_token * page) - 1), cap * -(-capacity // page))
        return KVBudget(True, page, pages, per_token, cap, capacity)
    slot = slot_size(capacity)
    rows = min(cap, max(0, budget) // (per_token * slot))
    return KVBudget(False, slot, rows, per_token, rows, capacity)


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V for one position of one row, over all layers (local heads under TP)."""
    attn = model.layers[0].attention
    elem = torch.empty((), dtype=model.dtype).element_size()
    return 2 * model.cfg.num_layers * attn.num_kv_heads * attn.head_dim * elem


def kv_bytes_per_token_of(config, tp: int, dtype: torch.dtype) -> int:
    """``kv_bytes_per_token`` from a ModelConfig, before any weights are loaded (KV heads
    split ``tp`` ways, at least one per rank)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * max(1, config.num_kv_heads // tp) * config.head_dim * elem


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available // 2)


def plan_for(model, capacity: int, *, paged: bool, kv_cache_memory: int | None = None,
             memory_utilization: float = MEMORY_UTILIZATION,
             max_num_seqs: int | None = None) -> KVBudget:
    """``plan_kv`` for a loaded model in this process, from its device's free memory now (an
    in-process run: rows of up to ``capacity`` positions)."""
    return plan_kv(per_token=kv_bytes_per_token(model), free=free_bytes(model.device),
                   capacity=capacity, paged=paged, cuda=model.device.type == "cuda",
                   kv_cache_memory=kv_cache_memory, memory_utilization=memory_utilization,
                   max_num_seqs=max_num_seqs,
                   page=page_size(attention_backend(model)))


def kv_source(kv_cache_memory: int | None, memory_utilization: float, where: str) -> str:
    """Where a KV cache's bytes came from, in errors: the very bytes the user gave (the
    scratch page included: the cache holds its rows' pages in what is left), or the share."""
    if kv_cache_memory is not None:
        return f"--kv-cache-memory {format_size(kv_cache_memory)}"
    return f"--memory-utilization {memory_utilization:g} of {where}"


def kv_memory_option(value: int | str | None) -> int | None:
    """``--kv-cache-memory`` as bytes: whole bytes, a size with its unit, or None (the table's
    rule, option_rules.py)."""
    return check("kv_cache_memory", value)


def check_utilization(value: float) -> float:
    return check("memory_utilization", value)
