"""A compact Llama / Qwen3 decoder whose 2L sublayers can each be executed or skipped.

Sublayer ``item`` 2l is the Attention of layer l, 2l+1 its MLP; each is ``h + f(norm(h))``, so
skipping one is the identity. Sequences in a batch keep their own positions (no padding): a
forward feeds T new tokens per sequence at positions ``start[b] .. start[b]+T-1`` and writes
their K/V into the preallocated cache (see cache.py); attention over the cache, per device, is
attention.py, and the per-forward metadata forward_meta.py. Tensor parallelism is applied from
outside (parallel/layers.py): a sublayer calls ``self.reduce`` on its partial output, and the
embedding and lm_head modules are swapped for vocab-parallel ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from knapspec_dist.model.attention import attend
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.config import ModelConfig
from knapspec_dist.model.forward_meta import ForwardMeta, forward_meta
from knapspec_dist.model.head import LMHead


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling; scaled types (llama3, ...) via transformers."""
    with torch.device("cpu"):  # real numbers even while the model is built on the meta device
        return _rope_frequencies(cfg)


def _rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    if cfg.rope["rope_type"] == "default":
        dim = cfg.head_dim
        inv = 1.0 / (cfg.rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv, 1.0
    return ROPE_INIT_FUNCTIONS[cfg.rope["rope_type"]](cfg.hf_config(), torch.device("cpu"))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, meta: ForwardMeta
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, hd] -> rotated [B, H, T, hd]; k [B, T, KV, hd] -> rotated, same shape."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    q = q * meta.cos + rotate_half(q) * meta.sin
    k = k * meta.cos + rotate_half(k) * meta.sin
    return q, k.transpose(1, 2)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class Capture(list):
    """Hidden states after each sublayer of one forward, keeping only the last ``keep`` positions
    (a long prefill must not hold 2L copies of every position)."""

    def __init__(self, keep: int | None = None):
        super().__init__()
        self.keep = keep

    def add(self, h: torch.Tensor) -> None:
        self.append(h if self.keep is None else h[:, -self.keep:])


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads  # local under TP
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hd, bias = cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.reduce = identity
        self.rotary = apply_rotary  # a CPU's one-pass kernel is set from outside (cpu_ops.py)
        self.merged: nn.Module | None = None  # q, k, v as one product (cpu_linear.py)

    def qkv(self, x: torch.Tensor, meta: ForwardMeta
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed input -> rotated q [B,H,T,hd], k and v [B,T,KV,hd]."""
        b, t, _ = x.shape
        q, k, v = (self.merged(x) if self.merged is not None
                   else (self.q_proj(x), self.k_proj(x), self.v_proj(x)))
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, meta)
        return q, k, v

    def forward(self, h: torch.Tensor, meta: ForwardMeta, cache: KVCache, layer: int
                ) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(h), meta)
        keys, values = cache.write(layer, meta, k, v)
        return h + self.reduce(self.o_proj(attend(q, keys, values, meta)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        bias = cfg.mlp_bias
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.reduce = identity
        self.gated = silu_and_mul  # a CPU's one-pass kernel is set from outside (cpu_ops.py)
        self.merged: nn.Module | None = None  # gate and up as one product (cpu_linear.py)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        gate, up = (self.merged(x) if self.merged is not None
                    else (self.gate_proj(x), self.up_proj(x)))
        return h + self.reduce(self.down_proj(self.gated(gate, up)))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.mlp = MLP(cfg)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq, self.rope_scale = rope_frequencies(cfg)
        self.backend: str | None = None  # attention backend; None: the device's default
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def forward_items(self, h: torch.Tensor, meta: ForwardMeta, cache: KVCache,
                      skip: frozenset[int] = frozenset(),
                      capture: Capture | None = None) -> torch.Tensor:
        """Run every sublayer not in ``skip``.

        ``capture`` receives the input h, then h after each of the 2L items (2L + 1 tensors).
        """
        if capture is not None:
            capture.add(h)
        for i, layer in enumerate(self.layers):
            if 2 * i not in skip:
                h = layer.attention(h, meta, cache, i)
            if capture is not None:
                capture.add(h)
            if 2 * i + 1 not in skip:
                h = layer.mlp(h)
            if capture is not None:
                capture.add(h)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden states ``h``: the head sums and keeps fp32 (``head_logits``)."""
        return self.lm_head(self.norm(h))

    def forward(self, tokens: torch.Tensor, starts: Sequence[int] | torch.Tensor, cache: KVCache,
                rows: slice | None = None, skip: frozenset[int] = frozenset(),
                last_only: bool = False, capture: Capture | None = None,
                starts_dev: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (fp32) for ``tokens`` [B, T] at positions ``starts[b] ..``, writing their K/V
        (``starts_dev``: host ``starts`` already on the device, see ``forward_meta``)."""
        rows = rows if rows is not None else slice(0, tokens.shape[0])
        meta = forward_meta(self, starts, tokens.shape[1], cache, rows, starts_dev)
        h = self.forward_items(self.embed(tokens), meta, cache, skip, capture)
        if last_only:
            h = h[:, -1:]
        return self.logits(h)
