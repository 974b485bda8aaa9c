"""Token choice and draft acceptance, greedy or sampled, with randomness that belongs to the row.

Sampling is the Gumbel-max trick: the token at a row's output index t is
``argmax(warped_logits / T + G)``, where ``warped`` applies top-k / top-p (-inf outside) and
``G`` is Gumbel noise over the vocabulary that depends only on the row's seed and on t
(``gumbel``: a counter-based hash of a 64-bit (row, index) key and the token, no generator
state). That is an exact sample from ``softmax(warped / T)`` up to the 2^-52 resolution of the
uniforms behind the noise, which lie strictly inside (0, 1): the noise is always finite, so no
token outside the top-k / top-p support can win. Only the candidates that can win need noise:
on a CPU, where noise and a sort over a 49k-152k vocabulary cost as much as a small model's
forward, the choice is made among the largest logits whenever that is provably the same choice.

Two ways to verify sampled drafts (``SamplingConfig.method``, ``--sampling``):

- ``coupled`` (the default): the way greedy drafts are verified, on perturbed logits. A draft
  token at index t is ``argmax(draft logits + G_t)`` with the same noise the target uses at t,
  and it is accepted iff it equals the target's ``argmax(target logits + G_t)``. So every
  emitted token is the token plain decoding would sample with the same seeds: sampled output
  is lossless token for token (not only in distribution), and a row's text depends on its
  prompt, options and seed alone, never on the rows batched beside it, the replica, the
  admission order or a resume. A draft is accepted with probability at least
  (1 - TV(p, q)) / (1 + TV(p, q)).
- ``rejection``: standard speculative rejection sampling (``engine/rejection.py``), which
  accepts with probability 1 - TV(p, q) and emits tokens distributed as plain sampling, but
  not plain sampling's tokens: they depend on where the rounds' drafts fell.

Each purpose draws from its own stream of the row's noise (``stream``: the Gumbel noise of
choices, rejection sampling's acceptance uniforms and its residual draws), all keyed by the
same 64-bit (row, index) key.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass

import torch

from knapspec_dist.errors import UserError
from knapspec_dist.option_rules import check_fields

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # the multiplier of a 32-bit avalanche hash; products stay below 2^59
_SALT = 0x9E3779B9  # separates the key's second 32-bit half from the first
_GRID = 2.0 ** -52  # the uniforms' resolution: (k + 1/2) * 2^-52 is exact in float64
# The largest noise value there is (u = 1 - 2^-53): a token whose logit is more than this below
# a candidate's perturbed logit can never win, which is what lets the choice skip its noise.
G_MAX = float(-torch.log(-torch.log(torch.tensor(1 - 2.0 ** -53, dtype=torch.float64))))
CANDIDATE_WIDTHS = (64, 1024)  # the top-k widths tried before the whole vocabulary
METHODS = ("coupled", "rejection")  # how sampled drafts are verified (module docstring)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    method: str = "coupled"  # one of METHODS; greedy decoding is the same under both

    def __post_init__(self):
        if self.method not in METHODS:
            raise UserError(f"sampling must be one of {', '.join(METHODS)}, got {self.method!r}")
        check_fields(self, ("temperature", "top_k", "top_p", "seed"))  # finite, in range

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def identical_to_plain(self) -> bool:
        """Whether speculation emits plain decoding's very tokens (greedy, or coupled
        sampling), not only tokens of its distribution (rejection sampling)."""
        return self.greedy or self.method == "coupled"

    @property
    def label(self) -> str:
        """``greedy``, or e.g. ``T 0.7, top-p 0.9, seed 0, rejection``: what reports print."""
        if self.greedy:
            return "greedy"
        cuts = (f", top-k {self.top_k}" if self.top_k else "") + (
            f", top-p {self.top_p:g}" if self.top_p < 1 else "")
        return f"T {self.temperature:g}{cuts}, seed {self.seed}, {self.method}"


def row_seed(seed: int | None, key: object) -> int:
    """The seed of one row: from (the request's seed, the row's key), so that it is the same
    wherever and whenever the row runs; random when the request has no seed."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") >> 2
    digest = hashlib.sha256(f"{seed}\x00{key!r}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2  # 62 bits: no int64 overflow below


def prompt_keys(prompts: list[list[int]]) -> list[tuple[tuple[int, ...], int]]:
    """Each prompt's sampling key: the prompt and how often it came before in ``prompts``, so
    that a seeded prompt gives the same text whatever else is asked with it."""
    seen: dict[tuple[int, ...], int] = {}
    keys = []
    for prompt in prompts:
        ids = tuple(prompt)
        seen[ids] = seen.get(ids, -1) + 1
        keys.append((ids, seen[ids]))
    return keys


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (a bijection) of int64 values in [0, 2^32)."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


@functools.lru_cache(maxsize=8)
def _token_hashes(vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token halves of the noise's hash: the same for every row and step, so made once."""
    ids = torch.arange(vocab, device=device, dtype=torch.int64)
    return _mix(ids), _mix(ids ^ _SALT)


def _keys(seeds: torch.Tensor, index: torch.Tensor, stream: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The 64-bit key of each (row, output index), as two 32-bit halves [B, T]: two rows share
    a whole noise vector only with probability 2^-64. ``stream`` (0-15) names the purpose: it
    sets the index's top four bits, which no output index (< 2^28) has, so the streams of a row
    never share a key."""
    lo, hi, t = seeds & _M32, (seeds >> 32) & _M32, (index & _M32) ^ (stream << 28)
    first = _mix(lo[:, None] ^ _mix(hi[:, None] ^ _mix(t)))
    second = _mix(hi[:, None] ^ _mix(lo[:, None] ^ _mix(t ^ _SALT)))
    return first, second


def _bits52(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """52 bits (int64 in [0, 2^52)) of two 32-bit hash halves."""
    return (first << 20) | (second >> 12)


def uniform(seeds: torch.Tensor, index: torch.Tensor, stream: int) -> torch.Tensor:
    """One uniform (float64, strictly inside (0, 1), on a 2^-52 grid) per row with ``seeds``
    [B] at output indices ``index`` [B, T], from the key of ``stream`` (> 0: not the noise's)."""
    return (_bits52(*_keys(seeds, index, stream)).double() + 0.5) * _GRID


def gumbel_of_bits(k: torch.Tensor) -> torch.Tensor:
    """Gumbel noise (fp32) from 52 random bits ``k`` (int64 in [0, 2^52)): ``u = (k + 1/2)
    2^-52`` is exact in float64 and strictly inside (0, 1), so the noise is finite (at most
    ``G_MAX``) and uniform at that resolution."""
    u = (k.double() + 0.5) * _GRID
    return (-torch.log(-torch.log(u))).float()


def _noise(first: torch.Tensor, second: torch.Tensor, h1: torch.Tensor,
           h2: torch.Tensor) -> torch.Tensor:
    """Gumbel noise from the keys and the tokens' hashes (broadcast): 52 bits of their
    64-bit hash."""
    return gumbel_of_bits(_bits52(_mix(first ^ h1), _mix(second ^ h2)))


def gumbel(seeds: torch.Tensor, index: torch.Tensor, vocab: int, stream: int = 0
           ) -> torch.Tensor:
    """Gumbel noise [B, T, vocab] (fp32) for rows with ``seeds`` [B] at output indices
    ``index`` [B, T]: a pure function of (seed, index, token, stream), the same on every
    device. Stream 0 is the choices' noise."""
    first, second = _keys(seeds, index, stream)
    h1, h2 = _token_hashes(vocab, seeds.device)
    return _noise(first[..., None], second[..., None], h1, h2)


def _noise_at(seeds: torch.Tensor, index: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``gumbel(seeds, index, V)`` gathered at token ``ids`` [B, T, K], without the rest."""
    first, second = _keys(seeds, index)
    return _noise(first[..., None], second[..., None], _mix(ids), _mix(ids ^ _SALT))


def _kept_mass(p_sorted: torch.Tensor) -> torch.Tensor:
    """The mass strictly above each token of a descending order: the top-p rule drops a token
    once it reaches top_p. An exclusive prefix sum, so it never decreases along the order, and
    (the CPU's cumsum being sequential) a prefix of the order gets the sums the whole gets."""
    total = torch.cumsum(p_sorted, dim=-1)
    return torch.cat([torch.zeros_like(total[..., :1]), total[..., :-1]], dim=-1)


def _kth_cut(z: torch.Tensor, kth: torch.Tensor | None) -> torch.Tensor:
    return z if kth is None else z.masked_fill(z < kth, float("-inf"))


def warped_top_k(z: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Tempered logits ``z`` with the top-k cut applied (-inf outside; ties at the k-th kept)."""
    if cfg.top_k and cfg.top_k < z.shape[-1]:
        return _kth_cut(z, torch.topk(z, cfg.top_k, dim=-1).values[..., -1:])
    return z


def warped(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Logits / temperature with top-k and top-p applied (-inf outside), fp32 [..., V]: the
    reference the candidate path (``_choose_among_candidates``) reproduces bit for bit."""
    z = warped_top_k(logits.float() / cfg.temperature, cfg)
    if cfg.top_p < 1.0:
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
        drop = _kept_mass(torch.exp(sorted_z - lse)) >= cfg.top_p  # the top token always stays
        kept = sorted_z.masked_fill(drop, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, order, kept)
    return z


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution tokens are drawn from: temperature, then top-k, then top-p. fp32."""
    if cfg.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return torch.softmax(warped(logits, cfg), dim=-1)


def confidence(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The top-1 probability [B] of the distribution each row of ``logits`` [B, V] draws from
    (drafting's early exit). With top-p it needs the nucleus' mass, found among the largest
    logits where it fits there (always on small vocabularies: then it is the whole row)."""
    if cfg.greedy or cfg.top_p == 1.0 or logits.device.type != "cpu":
        return probabilities(logits, cfg).amax(dim=-1)
    z = warped_top_k(logits.float() / cfg.temperature, cfg)
    width = min(z.shape[-1], CANDIDATE_WIDTHS[0])
    v = torch.topk(z, width, dim=-1).values
    p = torch.exp(v - torch.logsumexp(z, dim=-1, keepdim=True))
    kept = _kept_mass(p) < cfg.top_p
    if width < z.shape[-1] and not bool((torch.cumsum(p, dim=-1)[..., -1] >= cfg.top_p).all()):
        return probabilities(logits, cfg).amax(dim=-1)
    return p[..., 0] / (p * kept).sum(dim=-1)


def _first_best(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest id among the largest ``values`` [N, K]: what ``argmax`` over the
    whole vocabulary returns when values tie (its first maximal index)."""
    best = values.amax(dim=-1, keepdim=True)
    big = torch.iinfo(torch.int64).max
    return torch.where(values == best, ids, torch.full_like(ids, big)).amin(dim=-1)


def sample_everywhere(logits: torch.Tensor, cfg: SamplingConfig, seeds: torch.Tensor,
                      index: torch.Tensor) -> torch.Tensor:
    """The reference choice [B, T]: argmax of the warped logits plus the noise over every token."""
    return (warped(logits, cfg) + gumbel(seeds, index, logits.shape[-1])).argmax(dim=-1)


def _choose_among_candidates(z: torch.Tensor, cfg: SamplingConfig, seeds: torch.Tensor,
                             index: torch.Tensor, width: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference choice from the ``width`` largest logits only: the token [B, T] and
    whether it is proven to be the reference's [B, T].

    Let ``b`` be the smallest of the candidates' logits. Every token above ``b`` is a candidate
    and every other token lies at or below ``b`` (ties at ``b`` may straddle the cut, so those
    candidates are set aside). The choice is proven when the candidates hold the whole support
    (the top-k or top-p cut falls inside them) or when no outside token can win
    (``b + G_MAX`` is below the best candidate's perturbed logit). Warped values, top-p masses
    and noise are computed as ``warped`` and ``gumbel`` compute them, so a proven choice is the
    reference's to the bit.
    """
    v, ids = torch.topk(z, width, dim=-1)
    ids, by_id = ids.sort(dim=-1)  # ties in id order, as a stable sort of the whole row has them
    v, order = v.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    b = v[..., -1:]
    inside = v > b  # every token above b is here
    m = inside.sum(dim=-1, keepdim=True)  # how many candidates lie above b
    complete = torch.zeros_like(inside[..., 0])
    decidable = torch.ones_like(complete)
    kth = None
    if cfg.top_k and cfg.top_k < z.shape[-1]:
        known = m >= cfg.top_k  # the k-th value is among the candidates, above b
        kth = v[..., min(cfg.top_k, width) - 1:][..., :1]
        complete = complete | known[..., 0]
        inside = inside & (~known | (v >= kth))
        if cfg.top_p < 1.0:
            decidable = known[..., 0]  # top-p's normalizer needs the whole top-k support
    if cfg.top_p < 1.0:
        lse = torch.logsumexp(_kth_cut(z, kth), dim=-1, keepdim=True)
        p = torch.exp(v - lse).masked_fill(~inside, 0.0)
        above = _kept_mass(p)
        reached = torch.cumsum(p, dim=-1)[..., -1] >= cfg.top_p  # the first outside token drops
        inside = inside & (above < cfg.top_p)
        complete = complete | reached
    scores = (v + _noise_at(seeds, index, ids)).masked_fill(~inside, float("-inf"))
    best = scores.amax(dim=-1)
    proven = decidable & (complete | (b[..., 0] + G_MAX < best))
    return _first_best(scores, ids), proven


def sample(logits: torch.Tensor, cfg: SamplingConfig, seeds: torch.Tensor,
           index: torch.Tensor) -> torch.Tensor:
    """The token [B, T] each row samples at output indices ``index`` [B, T] from ``logits``
    [B, T, V] (greedy: the argmax; no seeds or indices needed).

    The sampled token is ``argmax(warped + G)`` over the vocabulary. On a CPU it is found from
    the largest logits (``_choose_among_candidates``), widening until proven, since noise and
    sort over 49k-152k tokens per position cost as much as a small model's forward; rows not
    proven take the whole vocabulary. On other devices the whole vocabulary is cheap and needs
    no read-back, so they take it directly.
    """
    if cfg.greedy:
        return logits.argmax(dim=-1)
    if logits.device.type != "cpu":
        return sample_everywhere(logits, cfg, seeds, index)
    b, t, vocab = logits.shape
    flat_logits = logits.reshape(b * t, 1, vocab)
    flat_z, flat_index = flat_logits.float() / cfg.temperature, index.reshape(b * t, 1)
    flat_seeds = seeds[:, None].expand(b, t).reshape(b * t)
    out = torch.empty(b * t, dtype=torch.int64)
    todo = torch.arange(b * t)
    # Without a cut only the bound can prove a choice, and at usual temperatures it does not.
    cut = cfg.top_p < 1.0 or 0 < cfg.top_k < vocab
    for width in CANDIDATE_WIDTHS if cut else ():
        if width >= vocab or not len(todo):
            break
        every = len(todo) == b * t  # no copy of the logits while every row is left
        tokens, proven = _choose_among_candidates(
            flat_z if every else flat_z[todo], cfg, flat_seeds if every else flat_seeds[todo],
            flat_index if every else flat_index[todo], width)
        proven = proven[:, 0]
        out[todo[proven]] = tokens[proven, 0]
        todo = todo[~proven]
    if len(todo):
        out[todo] = sample_everywhere(flat_logits[todo], cfg, flat_seeds[todo],
                                      flat_index[todo])[:, 0]
    return out.reshape(b, t)


def choose(logits: torch.Tensor, cfg: SamplingConfig, seeds: torch.Tensor,
           index: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [B, V], row b at output index ``index[b]`` (greedy:
    no seeds or indices needed)."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    return sample(logits[:, None], cfg, seeds, index[:, None])[:, 0]


def accept(drafts: torch.Tensor, target_logits: torch.Tensor, cfg: SamplingConfig,
           seeds: torch.Tensor, index: torch.Tensor, limit: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the longest prefix of ``drafts`` [B, g] that the target also chooses (at most
    ``limit`` [B] long) and the target's token after it: two [B] tensors on the device.

    ``target_logits`` [B, g+1, V] are the full model's logits at the pending token and each
    draft; ``index`` [B] is the output index of each row's first draft. Drafts past a row's
    limit were never meant to be verified: the token there is the target's own choice.
    """
    g = drafts.shape[1]
    if cfg.greedy:
        target = target_logits.argmax(dim=-1)
    else:
        indices = index[:, None] + torch.arange(g + 1, device=index.device)
        target = sample(target_logits, cfg, seeds, indices)
    n = (drafts == target[:, :g]).long().cumprod(1).sum(1)
    if limit is not None:
        n = torch.minimum(n, limit)
    return n, target.gather(1, n[:, None]).squeeze(1)
