"""Token choice and draft acceptance: greedy, and speculative rejection sampling.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) accepts draft token d ~ q with
probability min(1, p(d)/q(d)) and, on rejection, samples from norm(max(0, p - q)); the emitted
tokens are then distributed exactly as if sampled from the target p alone, whatever q is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from knapspec_dist.errors import UserError


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

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """Random numbers come from the model's device: a CPU generator cannot drive CUDA
        sampling, and a device one keeps draws off the host."""
        if self.greedy:
            return None
        g = torch.Generator(device=device)
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


def accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor,
                  limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the longest prefix of ``drafts`` [B, g] equal to the target's argmax (at most
    ``limit`` [B] long) and the target's next token: two [B] tensors on the device (no sync).

    ``target_logits`` [B, g+1, V] are the full model's logits at the pending token and each draft.
    """
    target = target_logits.argmax(dim=-1)
    g = drafts.shape[1]
    n = (drafts == target[:, :g]).long().cumprod(1).sum(1)
    if limit is not None:
        n = torch.minimum(n, limit)
    return n, target.gather(1, n[:, None]).squeeze(1)


def accept_sampling(drafts: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor,
                    cfg: SamplingConfig, gen: torch.Generator | None,
                    limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling per row: (accepted count, token emitted after them), [B].

    ``drafts`` [B, g] were drawn from ``draft_probs`` [B, g, V]; ``target_logits`` [B, g+1, V].
    All drafts are judged at once on the device. ``limit`` [B] caps the accepted count (drafts
    after a row's first unsure draft were never meant to be verified); reaching it emits a
    token from the target's own distribution there, as if those drafts did not exist.
    """
    p = probabilities(target_logits, cfg)  # [B, g+1, V]
    b, g = drafts.shape
    pd = p[:, :g].gather(2, drafts[..., None]).squeeze(2)
    qd = draft_probs.gather(2, drafts[..., None]).squeeze(2)
    u = torch.rand(b, g, generator=gen, device=p.device)
    ok = (qd > 0) & (u * qd < pd)  # u < min(1, p/q), without dividing by q
    n = ok.long().cumprod(1).sum(1)
    cap = torch.full_like(n, g) if limit is None else limit
    n = torch.minimum(n, cap)
    residual = (p[:, :g] - draft_probs).clamp_min(0)
    total = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p[:, :g])
    rejected = torch.cat([residual, p[:, g:g + 1]], dim=1)  # row g: every draft accepted
    at = n[:, None, None].expand(b, 1, p.shape[-1])
    dist = torch.where((n < cap)[:, None], rejected.gather(1, at).squeeze(1),
                       p.gather(1, at).squeeze(1))
    return n, torch.multinomial(dist, 1, generator=gen).squeeze(1)
