"""Distribution checks the sampling tests share: chi-square goodness of fit against an exact
distribution, transformers' warpers as the reference, per-row seeds, and the exact
distribution of a tiny model's first tokens under plain sampling."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from knapspec_dist.engine.sampling import SamplingConfig, row_seed
from knapspec_dist.model.cache import KVCache

ALPHA = 1e-3
Z_ALPHA = 3.0902  # standard normal upper 1e-3 quantile


def chi2_critical(df: int) -> float:
    """Upper ALPHA quantile of chi-square(df), Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_ALPHA * math.sqrt(a)) ** 3


def chi_square(counts: Counter, probs: dict, n: int) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells with expected < 5 are pooled."""
    assert abs(sum(probs.values()) - 1) < 1e-4
    assert set(counts) <= {k for k, p in probs.items() if p > 0}, "sampled a zero-probability cell"
    cells, pool_obs, pool_exp = [], 0, 0.0
    for key, p in probs.items():
        exp = n * p
        if exp < 5:
            pool_obs, pool_exp = pool_obs + counts.get(key, 0), pool_exp + exp
        else:
            cells.append((counts.get(key, 0), exp))
    if pool_exp > 0:
        cells.append((pool_obs, pool_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, len(cells) - 1


def assert_fits(samples: list, probs: dict, what: str) -> None:
    n = len(samples)
    stat, df = chi_square(Counter(samples), probs, n)
    assert df >= 1
    assert stat < chi2_critical(df), f"{what}: chi2={stat:.1f} df={df} n={n}"


def tv(samples: list, probs: dict) -> float:
    c = Counter(samples)
    keys = set(c) | set(probs)
    return 0.5 * sum(abs(c.get(k, 0) / len(samples) - probs.get(k, 0.0)) for k in keys)


def hf_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """transformers' warpers, in generate's order: temperature, top-k, top-p."""
    x = logits.float().clone()
    if cfg.temperature not in (0, 1):
        x = TemperatureLogitsWarper(cfg.temperature)(None, x)
    if cfg.top_k:
        x = TopKLogitsWarper(cfg.top_k)(None, x)
    if cfg.top_p < 1:
        x = TopPLogitsWarper(cfg.top_p)(None, x)
    return torch.softmax(x, dim=-1)


def seeds_of(n: int, seed: int = 1234) -> torch.Tensor:
    return torch.tensor([row_seed(seed, i) for i in range(n)], dtype=torch.int64)


NEW = 4  # tokens per sample: the first from prefill, then rounds of up to 2 drafts
PROMPT = [3, 5, 2, 7, 4, 6]


def exact_distribution(model, cfg: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(first NEW tokens) under plain sampling from the model, with transformers' warpers."""
    vocab = model.cfg.vocab_size
    prefixes = list(itertools.product(range(vocab), repeat=NEW - 1))
    batch = torch.tensor([PROMPT + list(pre) for pre in prefixes])
    cache = KVCache(model.cfg, len(prefixes), batch.shape[1], dtype=model.dtype, device="cpu")
    with torch.inference_mode():
        logits = model(batch, cache.lengths[slice(0, len(prefixes))],
                       cache)
    start = len(PROMPT) - 1
    step_probs = hf_probs(logits[:, start:start + NEW].reshape(-1, vocab), cfg)
    step_probs = step_probs.reshape(len(prefixes), NEW, vocab)
    joint = {}
    for row, pre in enumerate(prefixes):
        for last in range(vocab):
            seq = pre + (last,)
            p = 1.0
            for i, tok in enumerate(seq):
                p *= float(step_probs[row, i, tok])
            if p > 0:
                joint[seq] = p
    return joint


def marginal(joint: dict, idx: tuple[int, ...]) -> dict:
    out: dict = {}
    for seq, p in joint.items():
        key = tuple(seq[i] for i in idx)
        out[key] = out.get(key, 0.0) + p
    return out


def assert_matches_exact(samples: list[tuple[int, ...]], joint: dict, what: str) -> None:
    # Token 1 comes from the prefill in every strategy; tokens 2.. come from speculation.
    for idx in ((0,), (1,), (2,), (3,), (0, 1), (1, 2), (2, 3)):
        sub = [tuple(s[i] for i in idx) for s in samples]
        assert_fits(sub, marginal(joint, idx), f"{what}, tokens {idx}")
