"""The KnapSpec DP's tensors: the full model's hidden states at reference positions, and
candidate states pushed through one sublayer at a time, every DP budget in one batched forward.

A reference is a row's last committed positions (captured for free during verification);
a candidate's attention attends to that row's cached prefix (the full model's K/V) and,
causally, to its own K/V at those positions, as a draft would (tests/test_knapspec.py
checks the states against a drafted forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from knapspec_dist.model.attention import prefix_attention
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.decoder import Attention, Transformer
from knapspec_dist.model.forward_meta import forward_meta


@dataclass
class Reference:
    """The full model's hidden states at one row's last committed positions."""

    slot: int  # the row's cache row
    start: int  # position of the first state (the prefix before it is in the cache)
    states: torch.Tensor  # [2L + 1, m, d]: input, then after each item


class HiddenStateEvaluator:
    """The DP's tensors: one batched sublayer forward per (stage, execute) over all budgets,
    at every reference position of every reference row."""

    def __init__(self, model: Transformer, cache: KVCache, references: list[Reference]):
        self.model, self.cache = model, cache
        self.reference = torch.cat([r.states for r in references], dim=1)  # [2L + 1, M, d]
        self.blocks = []  # (cache row, prefix length, forward meta, causal mask, positions)
        offset = 0
        for r in references:
            m = r.states.shape[1]
            meta = forward_meta(model, [r.start], m, cache, slice(r.slot, r.slot + 1))
            causal = torch.ones(m, m, dtype=torch.bool, device=r.states.device).tril()
            self.blocks.append((r.slot, r.start, meta, causal, slice(offset, offset + m)))
            offset += m
        self.current: dict[int, torch.Tensor] = {0: self.reference[0]}
        self.pending: dict[tuple[int, bool], torch.Tensor] = {}

    def evaluate(self, item: int, sources: list[int], execute: bool) -> list[float]:
        x = torch.stack([self.current[j] for j in sources])
        if execute:
            layer = self.model.layers[item // 2]
            x = self._attention(layer.attention, item // 2, x) if item % 2 == 0 else layer.mlp(x)
        for j, state in zip(sources, x):
            self.pending[(j, execute)] = state
        target = self.reference[item + 1]
        cos = F.cosine_similarity(x.float(), target.float()[None], dim=-1).mean(dim=-1)
        return cos.tolist()

    def keep(self, item: int, chosen: dict[int, tuple[int, bool]]) -> None:
        self.current = {j: self.pending[src] for j, src in chosen.items()}
        self.pending = {}

    def _attention(self, attn: Attention, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Attention sublayer of N candidate states [N, M, d], each reference row's positions
        against that row's cache."""
        out = torch.cat([self._row_attention(attn, layer, x[:, positions], slot, prefix, meta,
                                             causal)
                         for slot, prefix, meta, causal, positions in self.blocks], dim=1)
        return x + attn.reduce(attn.o_proj(out.to(x.dtype)))

    def _row_attention(self, attn: Attention, layer: int, x: torch.Tensor, slot: int, prefix: int,
                       meta, causal: torch.Tensor) -> torch.Tensor:
        """Attention of N candidate states at one row's m reference positions: each attends to
        the cached prefix (the full model's K/V) and, causally, to its own K/V, as a draft
        would. The two parts are merged through the prefix's log-sum-exp. [N, m, H * hd]."""
        n, m, _ = x.shape
        q, k, v = attn.qkv(attn.norm(x), meta)
        kv, hd = attn.num_kv_heads, attn.head_dim
        g, scale = attn.num_heads // kv, attn.head_dim ** -0.5
        q = q.reshape(n, kv, g * m, hd)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [N, KV, m, hd]
        own = (q @ k.transpose(-1, -2)) * scale  # [N, KV, g*m, m]
        own = own.masked_fill(~causal.repeat(g, 1), float("-inf"))
        if not prefix:
            out = torch.softmax(own, dim=-1) @ v
        else:
            # All N states share the prefix: one attention per KV head with N folded into rows.
            rows = q.transpose(0, 1).reshape(1, kv, n * g * m, hd)
            out_p, lse = prefix_attention(rows, *self.cache.row_kv(layer, slot, prefix), scale)
            out_p = out_p.reshape(kv, n, g * m, hd).transpose(0, 1)
            lse = lse.reshape(kv, n, g * m, 1).transpose(0, 1)
            top = torch.maximum(own.amax(dim=-1, keepdim=True), lse)
            w_own, w_prefix = (own - top).exp(), (lse - top).exp()
            # v.to: on a CPU the fused kernel's log-sum-exp is fp32 even for a bf16 model
            out = (w_prefix * out_p + w_own @ v.to(w_own.dtype)) / (
                w_prefix + w_own.sum(dim=-1, keepdim=True))
        return out.reshape(n, attn.num_heads, m, hd).transpose(1, 2).reshape(n, m, -1)
