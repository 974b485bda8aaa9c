"""Tensor-parallel layers applied from outside the model (in the spirit of gpt-fast's ``tp.py``).

Megatron-style sharding over ``tp`` ranks: q/k/v/gate/up are column-parallel (each rank holds
a slice of the output features, i.e. whole attention heads and a slice of the MLP width),
o_proj/down_proj are row-parallel (a slice of the input features) followed by ONE all-reduce
per sublayer through the model's ``Attention.reduce`` / ``MLP.reduce`` hooks. A row-parallel
bias is loaded on rank 0 only (zeros elsewhere), so the all-reduce adds it exactly once.
The embedding and the lm_head are vocab-parallel: each rank holds ``ceil(V / tp)`` rows
(the last rank's slice is zero-padded when ``V % tp != 0``); the embedding zeroes ids outside
its slice and all-reduces, the lm_head computes its slice of the logits and all-gathers
(padding columns are dropped). Tied embeddings stay tied: both modules share one sliced weight.

Loading (parallel/loading.py) goes through ``model.weights.load_model(dir, slicer=...,
prepare=...)``: ``prepare`` (``shard_modules``) swaps the meta model's modules for their local
shapes, the slicer reads only this rank's slice of each sharded tensor with safetensors
``get_slice`` (never the whole tensor); norms are replicated. ``model.cfg`` keeps the GLOBAL
shape (profiles are keyed by it); the local head counts live on each ``Attention`` and in
``model.tp``; caches take ``kv_heads=local_kv_heads``.

SPMD determinism: every rank starts from the same embedding (an all-reduce of one non-zero
slice and zeros, exact) and every sublayer output is all-reduced, so the hidden states are the
same on every rank as long as the backend's all-reduce hands every rank the same bits (gloo
and NCCL do: the reduced chunks are broadcast around the ring; with 2 ranks a+b == b+a
anyway). Logits come from an all-gather, hence identical on every rank by construction, so
token choices, early exits and acceptance agree. Draft plans are additionally broadcast from
rank 0 (``speculation/spmd.py``), so a divergent selection can never desynchronize the collectives
of the decode loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from knapspec_dist.errors import UserError
from knapspec_dist.model.config import ModelConfig
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.model.head import head_logits
from knapspec_dist.parallel.comm import Comm


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
    """This rank's vocab slice of the logits (fp32, ``product`` as model/head.py's), all-gathered
    into the full [.., V] logits."""

    product = staticmethod(head_logits)

    def __init__(self, lay: Layout, hidden: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(lay.vocab_chunk, hidden))
        self.vocab, self.comm = lay.vocab, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.comm.all_gather_last(self.product(x, self.weight))
        return full[..., :self.vocab] if full.shape[-1] != self.vocab else full


@dataclass
class TPInfo:
    """Attached to a sharded model as ``model.tp``."""

    layout: Layout
    comm: Comm


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
