"""Speculative rejection sampling (``--sampling rejection``; Leviathan et al. 2023, Chen et al.
2023): accept a draft x ~ q with probability min(1, p(x) / q(x)), on rejection draw from the
residual norm(max(0, p - q)), after every draft accepted draw the bonus token from p.

Every emitted token is distributed as plain sampling's, and a draft is accepted with
probability 1 - TV(p, q), above the Gumbel coupling's (engine/sampling.py). The randomness is
the row's own, counter-based, one stream per purpose at each output index: the draft is
``argmax(draft warped + G_t)`` (stream 0, as every choice), its test uses a uniform (stream
``ACCEPT``), the residual its own Gumbel noise (stream ``RESIDUAL``) and the bonus token the
choices' noise. Given the seed and where the rounds' drafts fell, the tokens are fixed; they
are not plain sampling's tokens, and a different plan, draft length or batch (which caps the
draft length) gives different, equally distributed tokens.

Nothing here reads a value back to the host: the round's one read-back stays the only one.
"""

from __future__ import annotations

import torch

from knapspec_dist.engine.sampling import SamplingConfig, accept, gumbel, probabilities, uniform

ACCEPT, RESIDUAL = 1, 2  # the noise streams of the acceptance test and of the residual draw


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` [B, T, V] at position ``index[b]`` of each row: [B, V]."""
    return x.gather(1, index[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]


def accept_rejection(drafts: torch.Tensor, draft_logits: torch.Tensor,
                     target_logits: torch.Tensor, cfg: SamplingConfig, seeds: torch.Tensor,
                     index: torch.Tensor, limit: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept``'s contract under rejection sampling: per row, how many of ``drafts`` [B, g]
    are kept (at most ``limit`` [B]) and the token after them, two [B] tensors on the device.

    ``draft_logits`` [B, g, V] are the logits each draft was sampled from, ``target_logits``
    [B, g+1, V] the full model's at the pending token and each draft, ``index`` [B] the output
    index of each row's first draft. Greedy decoding, or a round without drafts, is ``accept``.
    """
    g = drafts.shape[1]
    if cfg.greedy or not g:
        return accept(drafts, target_logits, cfg, seeds, index, limit)
    indices = index[:, None] + torch.arange(g + 1, device=index.device)
    p = probabilities(target_logits, cfg)  # [B, g+1, V]
    q = probabilities(draft_logits, cfg)  # [B, g, V]
    px = p[:, :g].gather(-1, drafts[..., None])[..., 0].double()
    qx = q.gather(-1, drafts[..., None])[..., 0].double()  # > 0: x was drawn from q
    kept = uniform(seeds, indices[:, :g], ACCEPT) * qx < px  # probability min(1, p(x) / q(x))
    count = kept.long().cumprod(1).sum(1)
    n = count if limit is None else torch.minimum(count, limit)
    rejected = count < (g if limit is None else limit.clamp(max=g))
    p_n = _at(p, n)
    residual = (p_n - _at(q, n.clamp(max=g - 1))).clamp(min=0)
    # A rejection leaves residual mass (q(x) > p(x)); an all-zero one is rounding: p is left.
    residual = torch.where((residual.sum(-1, keepdim=True) > 0), residual, p_n)
    weights = torch.where(rejected[:, None], residual, p_n)
    at = (index + n)[:, None]
    vocab = p.shape[-1]
    noise = torch.where(rejected[:, None], gumbel(seeds, at, vocab, RESIDUAL)[:, 0],
                        gumbel(seeds, at, vocab)[:, 0])
    return n, (torch.log(weights) + noise).argmax(dim=-1)
