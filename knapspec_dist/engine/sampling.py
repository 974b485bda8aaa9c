"""Token choice and draft acceptance, greedy or sampled, with randomness that belongs to the row.

Sampling is the Gumbel-max trick: the token at a row's output index t is
``argmax(warped_logits / T + G)``, where ``warped`` applies top-k / top-p (-inf outside) and
``G`` is Gumbel noise over the vocabulary that depends only on the row's seed and on t
(``gumbel``: a counter-based hash, no generator state). That is an exact sample from
``softmax(warped / T)`` (up to the 2^-24 resolution of the uniforms behind the noise).

Speculation verifies sampled drafts the way it verifies greedy ones, on perturbed logits: a
draft token at index t is ``argmax(draft logits + G_t)`` with the same noise the target uses
at t, and it is accepted iff it equals the target's ``argmax(target logits + G_t)``. So every
emitted token is the token plain decoding would sample with the same seeds: sampled output is
lossless token for token (not only in distribution), and a row's text depends on its prompt,
options and seed alone, never on the rows batched beside it, the replica, the admission order
or a resume. (Rejection sampling, which this replaces, accepts drafts more often, 1 - TV(p, q)
against the Gumbel coupling's at least (1 - TV) / (1 + TV), but its draws depend on how many
drafts a round made, i.e. on the batch.)
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass

import torch

from knapspec_dist.errors import UserError

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # the multiplier of a 32-bit avalanche hash; products stay below 2^59


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def row_seed(seed: int | None, key: object) -> int:
    """The seed of one row: from (the request's seed, the row's key), so that it is the same
    wherever and whenever the row runs; random when the request has no seed."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") >> 2
    digest = hashlib.sha256(f"{seed}\x00{key!r}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2  # 62 bits: no int64 overflow below


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (a bijection) of int64 values in [0, 2^32)."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


@functools.lru_cache(maxsize=8)
def _token_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """The per-token half of the noise's hash: the same for every row and step, so made once."""
    return _mix(torch.arange(vocab, device=device, dtype=torch.int64))


def gumbel(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [B, T, vocab] (fp32) for rows with ``seeds`` [B] at output indices
    ``steps`` [B, T]: a pure function of (seed, step, token), the same on every device."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    base = _mix(lo[:, None] ^ _mix(hi[:, None] ^ _mix(steps & _M32)))  # [B, T]
    h = _mix(base[..., None] ^ _token_hashes(vocab, seeds.device))
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(-torch.log(u))


def warped(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Logits / temperature with top-k and top-p applied (-inf outside), fp32 [..., V]."""
    logits = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        p = torch.softmax(sorted_logits, dim=-1)
        drop = p.cumsum(dim=-1) - p >= cfg.top_p  # keep the first token past top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution tokens are drawn from: temperature, then top-k, then top-p. fp32."""
    if cfg.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return torch.softmax(warped(logits, cfg), dim=-1)


def perturbed(logits: torch.Tensor, cfg: SamplingConfig, seeds: torch.Tensor,
              steps: torch.Tensor) -> torch.Tensor:
    """What a token is the argmax of: the logits themselves (greedy), or the warped logits
    plus each row's noise at ``steps`` [B, T] (``logits`` [B, T, V])."""
    if cfg.greedy:
        return logits
    return warped(logits, cfg) + gumbel(seeds, steps, logits.shape[-1])


def choose(logits: torch.Tensor, cfg: SamplingConfig, seeds: torch.Tensor,
           steps: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [B, V], row b at output index ``steps[b]`` (greedy:
    no seeds or steps needed)."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    return perturbed(logits[:, None], cfg, seeds, steps[:, None])[:, 0].argmax(dim=-1)


def accept(drafts: torch.Tensor, target_logits: torch.Tensor, cfg: SamplingConfig,
           seeds: torch.Tensor, steps: torch.Tensor, limit: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the longest prefix of ``drafts`` [B, g] that the target also chooses (at most
    ``limit`` [B] long) and the target's token after it: two [B] tensors on the device.

    ``target_logits`` [B, g+1, V] are the full model's logits at the pending token and each
    draft; ``steps`` [B] is the output index of each row's first draft. Drafts past a row's
    limit were never meant to be verified: the token there is the target's own choice.
    """
    g = drafts.shape[1]
    if cfg.greedy:
        target = target_logits.argmax(dim=-1)
    else:
        index = steps[:, None] + torch.arange(g + 1, device=steps.device)
        target = perturbed(target_logits, cfg, seeds, index).argmax(dim=-1)
    n = (drafts == target[:, :g]).long().cumprod(1).sum(1)
    if limit is not None:
        n = torch.minimum(n, limit)
    return n, target.gather(1, n[:, None]).squeeze(1)
