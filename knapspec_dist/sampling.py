"""Token choice and draft acceptance: greedy, and speculative rejection sampling.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) accepts draft token d ~ q with
probability min(1, p(d)/q(d)) and, on rejection, samples from norm(max(0, p - q)); the emitted
tokens are then distributed exactly as if sampled from the target p alone, whatever q is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UserError


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

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution tokens are drawn from: temperature, then top-k, then top-p. [N, V] fp32."""
    logits = logits.float()
    if cfg.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= cfg.top_p  # keep the first past top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


def choose(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` [N, V]."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, cfg), 1, generator=gen).squeeze(-1)


def accept_greedy(drafts: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix of ``drafts`` equal to the target's argmax, and the target's next token.

    ``target_logits`` [g+1, V] are the full model's logits at the pending token and each draft.
    """
    target = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n, target[n]


def accept_sampling(drafts: list[int], draft_probs: list[torch.Tensor], target_logits: torch.Tensor,
                    cfg: SamplingConfig, gen: torch.Generator | None) -> tuple[int, int]:
    """Speculative rejection sampling: (number accepted, token emitted after them)."""
    p = probabilities(target_logits, cfg)
    u = torch.rand(len(drafts), generator=gen).tolist()
    for i, (d, q) in enumerate(zip(drafts, draft_probs)):
        pd, qd = float(p[i, d]), float(q[d])
        if qd > 0 and u[i] < min(1.0, pd / qd):
            continue
        residual = (p[i] - q).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))
