"""Tensor parallelism applied from outside the model (in the spirit of gpt-fast's ``tp.py``).

Megatron-style sharding over ``tp`` ranks: q/k/v/gate/up are column-parallel (each rank holds
a slice of the output features, i.e. whole attention heads and a slice of the MLP width),
o_proj/down_proj are row-parallel (a slice of the input features) followed by ONE all-reduce
per sublayer through the model's ``Attention.reduce`` / ``MLP.reduce`` hooks. A row-parallel
bias is loaded on rank 0 only (zeros elsewhere), so the all-reduce adds it exactly once.
The embedding and the lm_head are vocab-parallel: each rank holds ``ceil(V / tp)`` rows
(the last rank's slice is zero-padded when ``V % tp != 0``); the embedding zeroes ids outside
its slice and all-reduces, the lm_head computes its slice of the logits and all-gathers
(padding columns are dropped). Tied embeddings stay tied: both modules share one sliced weight.

Loading goes through ``loading.load_model(dir, slicer=..., prepare=...)``: ``prepare`` swaps
the meta model's modules for their local shapes, the slicer reads only this rank's slice of
each sharded tensor with safetensors ``get_slice`` (never the whole tensor); norms are
replicated. ``model.cfg`` keeps the GLOBAL shape (profiles are keyed by it); the local head
counts live on each ``Attention`` and in ``model.tp``; caches take ``kv_heads=local_kv_heads``.

SPMD determinism: every rank starts from the same embedding (an all-reduce of one non-zero
slice and zeros, exact) and every sublayer output is all-reduced, so the hidden states are the
same on every rank as long as the backend's all-reduce hands every rank the same bits (gloo
and NCCL do: the reduced chunks are broadcast around the ring; with 2 ranks a+b == b+a
anyway). Logits come from an all-gather, hence identical on every rank by construction, so
token choices, early exits and acceptance agree. Draft plans are additionally broadcast from
rank 0 (``SyncedSelector``), so a divergent selection can never desynchronize the collectives
of the decode loop.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from knapspec_dist.model.cache import kv_heads  # noqa: F401 - exported by knapspec_dist.parallel
from knapspec_dist.clock import Clock
from knapspec_dist.model.config import ModelConfig, load_config
from knapspec_dist.errors import UserError
from knapspec_dist.model.weights import checkpoint_files, hf_name, load_model
from knapspec_dist.model.decoder import Transformer

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- process group

def free_port() -> int:
    """A TCP port free right now on this host (rank 0 picks it; tiny race, retried by callers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world: int, address: str, port: int, *, device: str = "cpu",
                     backend: str | None = None, timeout_s: float = 300.0):
    """Join the default process group: gloo on CPU, NCCL on CUDA. Returns the group (WORLD).

    ``timeout_s`` bounds how long a collective waits for a lagging rank; it must exceed the
    longest compute between two collectives (one sublayer of a prefill), so minutes is safe.
    """
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    log.info("rank %d/%d joined %s group at %s:%d", rank, world, backend, address, port)
    return dist.group.WORLD


def destroy_distributed(timeout_s: float = 300.0) -> None:
    """Leave the default process group together with the other ranks, then destroy it.

    Destroying a gloo group closes its TCP pairs and stops its worker threads. A rank that
    does so while a peer is still finishing the last collective (a ring all-reduce completes
    on one rank before the other has read its last chunk) breaks the peer's connection
    mid-operation, and on a busy machine that peer then aborts ("terminate called without an
    active exception"). So every rank first passes a barrier, then waits on the store until
    every rank has left it: only then is no collective in flight anywhere, and each rank
    destroys its group. Best effort: a peer that is gone already only costs the wait.
    """
    if not dist.is_initialized():
        return
    world = dist.get_world_size()
    if world > 1:
        try:
            dist.barrier()
            store = dist.distributed_c10d._get_default_store()
            store.add("knapspec/teardown", 1)
            deadline = time.monotonic() + timeout_s
            while store.add("knapspec/teardown", 0) < world and time.monotonic() < deadline:
                time.sleep(0.01)
        except Exception as e:  # noqa: BLE001 - a dead peer: destroy anyway
            log.warning("leaving the process group without the other ranks: %s", e)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- communication

@dataclass
class Comm:
    """The collectives of one rank, timed: ``seconds`` is wall time spent inside them.

    On CUDA the collectives are asynchronous; ``timed`` then synchronizes around each one
    (accurate but slower), otherwise only calls and bytes are counted.
    """

    group: object
    rank: int
    world: int
    timed: bool = True
    cuda: bool = False
    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    def _clock(self) -> float:
        return Clock("cuda" if self.cuda else "cpu").now()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = self._clock() if self.timed else 0.0
        dist.all_reduce(x, group=self.group)
        if self.timed:
            self.seconds += self._clock() - t0
        self.calls += 1
        self.bytes += x.numel() * x.element_size()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim (rank order)."""
        t0 = self._clock() if self.timed else 0.0
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        out = torch.cat(parts, dim=-1)
        if self.timed:
            self.seconds += self._clock() - t0
        self.calls += 1
        self.bytes += x.numel() * x.element_size() * self.world
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        t0 = self._clock() if self.timed else 0.0
        dist.broadcast(x, src=src, group=self.group)
        if self.timed:
            self.seconds += self._clock() - t0
        self.calls += 1
        self.bytes += x.numel() * x.element_size()
        return x

    def reset(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls, self.bytes = 0.0, 0, 0
        return out


# ----------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class Layout:
    """This rank's share of every sharded dimension."""

    rank: int
    world: int
    heads: int  # local attention heads
    kv_heads: int  # local KV heads
    intermediate: int  # local MLP width
    vocab_chunk: int  # rows of the vocab slice (padded on the last rank)
    vocab: int  # global vocabulary

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_chunk

    @property
    def vocab_end(self) -> int:  # exclusive, real rows only
        return min(self.vocab, self.vocab_start + self.vocab_chunk)


def check_shardable(cfg: ModelConfig, tp: int) -> None:
    """UserError unless heads, KV heads and MLP width divide evenly over ``tp`` ranks."""
    if tp < 1:
        raise UserError(f"tp must be >= 1, got {tp}")
    problems = [f"{what} {n}" for what, n in (("attention heads", cfg.num_heads),
                                                ("KV heads", cfg.num_kv_heads),
                                                ("MLP intermediate size", cfg.intermediate_size))
                if n % tp]
    if problems:
        ok = [d for d in range(1, cfg.num_heads + 1) if not (cfg.num_heads % d or
              cfg.num_kv_heads % d or cfg.intermediate_size % d)]
        raise UserError(f"cannot shard the model over tp={tp}: {', '.join(problems)} not "
                        f"divisible by {tp} (tp degrees that work: {', '.join(map(str, ok))})")


def layout(cfg: ModelConfig, rank: int, world: int) -> Layout:
    check_shardable(cfg, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")
    return Layout(rank, world, cfg.num_heads // world, cfg.num_kv_heads // world,
                  cfg.intermediate_size // world, math.ceil(cfg.vocab_size / world),
                  cfg.vocab_size)


# ----------------------------------------------------------------------------- modules

class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + chunk)`` of the embedding; other ids give zeros; all-reduce."""

    def __init__(self, lay: Layout, hidden: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(lay.vocab_chunk, hidden))
        self.start, self.chunk, self.comm = lay.vocab_start, lay.vocab_chunk, comm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.chunk)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0)
        return self.comm.all_reduce(out)


class VocabParallelLMHead(nn.Module):
    """This rank's vocab slice of the logits, all-gathered into the full [.., V] logits."""

    def __init__(self, lay: Layout, hidden: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(lay.vocab_chunk, hidden))
        self.vocab, self.comm = lay.vocab, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.comm.all_gather_last(F.linear(x, self.weight))
        return full[..., :self.vocab] if full.shape[-1] != self.vocab else full


@dataclass
class TPInfo:
    """Attached to a sharded model as ``model.tp``."""

    layout: Layout
    comm: Comm
    meta: dict = field(default_factory=dict)


def shard_modules(model: Transformer, lay: Layout, comm: Comm) -> None:
    """``prepare`` hook: give the (meta) model this rank's local shapes and the TP collectives."""
    cfg, hd = model.cfg, model.cfg.head_dim
    with torch.device("meta"):
        for layer in model.layers:
            a, m = layer.attention, layer.mlp
            a.q_proj = nn.Linear(cfg.hidden_size, lay.heads * hd, bias=cfg.attention_bias)
            a.k_proj = nn.Linear(cfg.hidden_size, lay.kv_heads * hd, bias=cfg.attention_bias)
            a.v_proj = nn.Linear(cfg.hidden_size, lay.kv_heads * hd, bias=cfg.attention_bias)
            a.o_proj = nn.Linear(lay.heads * hd, cfg.hidden_size, bias=cfg.attention_bias)
            a.num_heads, a.num_kv_heads = lay.heads, lay.kv_heads
            m.gate_proj = nn.Linear(cfg.hidden_size, lay.intermediate, bias=cfg.mlp_bias)
            m.up_proj = nn.Linear(cfg.hidden_size, lay.intermediate, bias=cfg.mlp_bias)
            m.down_proj = nn.Linear(lay.intermediate, cfg.hidden_size, bias=cfg.mlp_bias)
            if lay.world > 1:
                a.reduce = comm.all_reduce
                m.reduce = comm.all_reduce
        if lay.world > 1:
            model.embed = VocabParallelEmbedding(lay, cfg.hidden_size, comm)
            model.lm_head = VocabParallelLMHead(lay, cfg.hidden_size, comm)
    model.tp = TPInfo(lay, comm)


_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split output features (rows)
_ROW = ("o_proj", "down_proj")  # split input features (columns)


def make_slicer(cfg: ModelConfig, lay: Layout, files: dict[str, Path]):
    """``slicer(name, safetensors_slice, full_shape)`` -> only this rank's part of the tensor.

    safetensors returns slices as views of its memory map, and a page fault maps neighbouring
    file pages too (fault-around), so with ``load_model``'s handles open for the whole load a
    rank's RSS would grow by far more than its slices (every page of a column slice whose rows
    are shorter than a few pages). Each sharded tensor is therefore read through its own short
    ``safe_open`` handle, copied into this rank's memory, and the map closed: after loading a
    rank holds exactly its slices, and its peak is that plus one tensor's touched pages.
    """
    hd = cfg.head_dim
    rows_per = {"q_proj": lay.heads * hd, "k_proj": lay.kv_heads * hd,
                "v_proj": lay.kv_heads * hd, "gate_proj": lay.intermediate,
                "up_proj": lay.intermediate}
    cols_per = {"o_proj": lay.heads * hd, "down_proj": lay.intermediate}

    def read(name: str, index) -> torch.Tensor:
        source = hf_name(name)
        with safe_open(files[source], framework="pt") as f:
            view = f.get_slice(source)[index]
            out = torch.empty(view.shape, dtype=view.dtype)
            out.copy_(view)
            del view
        return out

    def slicer(name: str, sl, full: tuple[int, ...]) -> torch.Tensor:
        parts = name.split(".")
        if lay.world == 1:
            return sl[:]
        if parts[0] in ("embed", "lm_head"):
            piece = read(name, slice(lay.vocab_start, lay.vocab_end))
            pad = lay.vocab_chunk - piece.shape[0]
            return F.pad(piece, (0, 0, 0, pad)) if pad else piece
        module = parts[-2] if len(parts) >= 2 else ""
        if module in _COLUMN:
            n = rows_per[module]
            return read(name, slice(lay.rank * n, (lay.rank + 1) * n))
        if module in _ROW:
            n = cols_per[module]
            if parts[-1] == "bias":  # added once: rank 0 holds it, the all-reduce sums it in
                bias = read(name, slice(None))
                return bias if lay.rank == 0 else torch.zeros_like(bias)
            return read(name, (slice(None), slice(lay.rank * n, (lay.rank + 1) * n)))
        return read(name, slice(None))  # norms: replicated (small)

    return slicer


def load_sharded(model_dir: str | Path, rank: int, world: int, *, group=None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 timed: bool = True) -> Transformer:
    """Load this rank's shard of a checkpoint (world == 1: the whole model, ``model.tp`` set).

    The process group must already be initialized when world > 1.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(f"model path {str(model_dir)!r} does not exist or is not a folder")
    cfg = load_config(model_dir)
    lay = layout(cfg, rank, world)
    comm = Comm(group if group is not None else (dist.group.WORLD if world > 1 else None),
                rank, world, timed=timed, cuda=torch.device(device).type == "cuda")
    files = checkpoint_files(model_dir) if world > 1 else {}
    model = load_model(model_dir, dtype=dtype, device=device, slicer=make_slicer(cfg, lay, files),
                       prepare=lambda m: shard_modules(m, lay, comm))
    return model


def parameter_bytes(model: Transformer) -> int:
    """Bytes of this rank's parameters (a tied weight counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


# ----------------------------------------------------------------------------- SPMD strategies

def spmd_strategy(strategy, model: Transformer):
    """Make a strategy safe to run SPMD on every rank of a TP group: a self-speculative
    strategy's selector gets its plans broadcast from rank 0 (one tiny broadcast per round)."""
    tp = getattr(model, "tp", None)
    selector = getattr(strategy, "selector", None)
    if tp is None or tp.layout.world == 1 or selector is None or isinstance(selector, SyncedSelector):
        return strategy
    strategy.selector = SyncedSelector(selector, tp.comm)
    return strategy


class SyncedSelector:
    """Wraps a Selector: every rank runs it (its DP issues the same collectives everywhere),
    then rank 0's plan -- and the per-rank wall-clock quantities its schedule depends on
    (KnapSpec's ``next_selection``, set from its measured selection time, and
    ``last_select_s``, which decides whether a DP is worth running) -- is broadcast, so all
    ranks draft with the same subnet and gamma and run the DP at the same steps."""

    SCHEDULE = {"next_selection": 1, "last_select_s": 1_000_000}  # name: integer scale

    def __init__(self, inner, comm: Comm):
        self.inner, self.comm = inner, comm
        self.divergences = 0

    def __getattr__(self, name):  # selections, fallbacks, history, ...
        return getattr(self.inner, name)

    def start(self, model):
        return self.inner.start(model)

    def wants_reference(self):
        return self.inner.wants_reference()

    def observe(self, hidden, valid, rids):
        return self.inner.observe(hidden, valid, rids)

    def retire(self, rid):
        return self.inner.retire(rid)

    def record(self, steps, verified, accepted):
        return self.inner.record(steps, verified, accepted)

    def plan(self, model, batch):
        from knapspec_dist.spec.selfspec import Plan

        plan = self.inner.plan(model, batch)
        names = list(self.SCHEDULE)
        code = torch.zeros(model.cfg.num_items + 1 + len(names), dtype=torch.int64)
        code[0] = plan.gamma
        for k, name in enumerate(names):  # -1: the selector has none (yet)
            value = getattr(self.inner, name, None)
            code[1 + k] = -1 if value is None else int(value * self.SCHEDULE[name])
        first = 1 + len(names)
        if plan.skip:
            code[first + torch.tensor(sorted(plan.skip), dtype=torch.int64)] = 1
        if self.comm.cuda:
            code = code.cuda()
        self.comm.broadcast(code, src=0)
        code = code.cpu()
        agreed = Plan(frozenset(torch.nonzero(code[first:]).flatten().tolist()), int(code[0]))
        for k, name in enumerate(names):
            if hasattr(self.inner, name):
                value, scale = int(code[1 + k]), self.SCHEDULE[name]
                setattr(self.inner, name, None if value == -1 else
                        value if scale == 1 else value / scale)
        if agreed != plan:
            self.divergences += 1
            log.warning("rank %d: selector plan %s differs from rank 0's %s; using rank 0's",
                        self.comm.rank, plan, agreed)
            if hasattr(self.inner, "plan_now"):
                self.inner.plan_now = agreed
        return agreed
