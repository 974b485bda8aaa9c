"""Sampling is exact: speculative rejection sampling yields the target distribution.

Statistical tests use fixed seeds (so they are deterministic) and a stated tolerance: a
chi-square goodness-of-fit test against the exact distribution must not reject at
significance ALPHA = 1e-3 (cells with expected count < 5 pooled), and, where stated, the
total-variation distance must stay under a bound several standard errors wide.

The reference for temperature / top-k / top-p is transformers' own logits warpers.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from knapspec_dist.model.cache import KVCache
from knapspec_dist.errors import UserError
from knapspec_dist.model.weights import load_model
from knapspec_dist.engine.sampling import SamplingConfig, accept_sampling, probabilities
from knapspec_dist.spec import selfspec
from knapspec_dist.spec.autoregressive import Autoregressive
from knapspec_dist.spec.selfspec import SelfSpeculative, StaticSelector
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.scheduler import generate

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


# --------------------------------------------------------------------------- probabilities

@pytest.mark.parametrize("cfg", [
    SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.6),
    SamplingConfig(temperature=1.3, top_k=5), SamplingConfig(temperature=1.0, top_p=0.7),
    SamplingConfig(temperature=0.8, top_k=10, top_p=0.9), SamplingConfig(temperature=1.0, top_k=1),
])
def test_probabilities_match_transformers_warpers(cfg):
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    got, want = probabilities(logits, cfg), hf_probs(logits, cfg)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got > 0, want > 0)  # same support


def test_invalid_sampling_options_are_user_errors():
    for bad in (dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(UserError):
            SamplingConfig(**bad)


# --------------------------------------------------------------------------- accept_sampling

V = 6
TARGET = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                       [-1.0, 0.0, 2.5, 0.3, 1.0, -2.0],
                       [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]])


def one_hot(i: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), V).float()


DRAFTS = {
    "random q": torch.tensor([0.05, 0.4, 0.05, 0.3, 0.1, 0.1]),
    "q equals p": None,  # filled in with the target's own distribution
    "point mass on a rare token": one_hot(5),
    "point mass outside top-k": one_hot(4),
}


@pytest.mark.parametrize("case", list(DRAFTS))
@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0),
                                 SamplingConfig(temperature=0.7, top_k=3),
                                 SamplingConfig(temperature=1.2, top_p=0.8)],
                         ids=["t1", "t0.7-k3", "t1.2-p0.8"])
def test_accept_sampling_first_token_is_distributed_as_p(case, cfg):
    """d ~ q, then accept/resample: the emitted token is ~ p, whatever q is.

    N = 8000 draws; chi-square at ALPHA plus TV <= 0.03 (the TV of a correct sampler has
    expectation ~0.01 here); acceptance rate = sum min(p, q) within 4 standard errors."""
    p = hf_probs(TARGET, cfg)
    q = p[0].clone() if DRAFTS[case] is None else DRAFTS[case]
    gen = torch.Generator().manual_seed(1234)
    n = 8000
    draws = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    emitted, accepted = [], 0
    for d in draws:
        k, nxt = map(int, accept_sampling(torch.tensor([[d]]), q[None, None], TARGET[None, :2],
                                          cfg, gen))
        assert k in (0, 1)
        accepted += k
        emitted.append(d if k == 1 else nxt)
    probs = {i: float(p[0, i]) for i in range(V)}
    assert_fits(emitted, probs, f"{case} {cfg}")
    assert tv(emitted, probs) <= 0.03
    rate = float(torch.minimum(p[0], q).sum())
    se = math.sqrt(max(rate * (1 - rate), 1e-12) / n)
    assert abs(accepted / n - rate) <= 4 * se + 1e-9


def test_accept_sampling_chain_of_drafts_gives_joint_of_targets():
    """Two drafts d1 ~ q1, d2 ~ q2; the first two emitted tokens are ~ p1 x p2 (rows of the
    target independent of the prefix here). When d1 is rejected, the second token comes from
    the next round, which drafts again from q2."""
    cfg = SamplingConfig(temperature=1.0)
    p = hf_probs(TARGET, cfg)
    q1 = torch.tensor([0.1, 0.1, 0.5, 0.1, 0.1, 0.1])
    q2 = torch.tensor([0.3, 0.0, 0.0, 0.2, 0.2, 0.3])
    gen = torch.Generator().manual_seed(99)
    n = 10000
    pairs = []
    for _ in range(n):
        d1 = int(torch.multinomial(q1, 1, generator=gen))
        d2 = int(torch.multinomial(q2, 1, generator=gen))
        k, nxt = map(int, accept_sampling(torch.tensor([[d1, d2]]), torch.stack([q1, q2])[None],
                                          TARGET[None], cfg, gen))
        if k >= 1:
            pairs.append((d1, d2 if k == 2 else nxt))
        else:  # next round: the target row for position 2 is TARGET[1] again here
            d = int(torch.multinomial(q2, 1, generator=gen))
            k2, nxt2 = map(int, accept_sampling(torch.tensor([[d]]), q2[None, None], TARGET[None, 1:],
                                                cfg, gen))
            pairs.append((nxt, d if k2 else nxt2))
    probs = {(a, b): float(p[0, a] * p[1, b]) for a in range(V) for b in range(V)}
    assert_fits(pairs, probs, "joint of two emitted tokens")
    assert tv(pairs, probs) <= 0.05


# --------------------------------------------------------------------------- end to end

NEW = 4  # tokens per sample: the first from prefill, then rounds of up to 2 drafts
PROMPT = [3, 5, 2, 7, 4, 6]


@pytest.fixture(scope="module")
def tiny(tiny_vocab_checkpoint):
    return load_model(tiny_vocab_checkpoint)


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


def static_samples(model, cfg: SamplingConfig, n: int, skip=frozenset({2, 5}), gamma=3,
                   tau=0.0) -> tuple[list[tuple[int, ...]], int, int]:
    strategy = SelfSpeculative(StaticSelector(frozenset(skip), gamma), tau_conf=tau)
    out, drafted, accepted = [], 0, 0
    for i in range(n):
        c = GenerationConfig(max_new_tokens=NEW, stop_at_eos=False,
                             sampling=SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p,
                                                     seed=10_000 + i))
        r = generate(strategy, model, [PROMPT], c)[0]
        assert len(r.token_ids) == NEW
        out.append(tuple(r.token_ids))
        drafted += r.stats.drafted
        accepted += r.stats.accepted
    return out, drafted, accepted


SCENARIOS = {
    "t1": SamplingConfig(temperature=1.0),
    "t0.9-k6-p0.9": SamplingConfig(temperature=0.9, top_k=6, top_p=0.9),
}
N_STATIC = 800  # independent seeds per static scenario
N_AR = 1000  # rows of one batched ar call


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_static_sampling_matches_ar_sampling(name, tiny):
    """Empirical distribution of the first 4 tokens: `ar` (one batched call of N_AR rows) and
    `static` (N_STATIC independent seeds) both fit the exact distribution (chi-square at ALPHA
    on every single-token and adjacent-pair marginal)."""
    cfg = SCENARIOS[name]
    joint = exact_distribution(tiny, cfg)
    seeded = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, seed=5)
    ar = generate(Autoregressive(), tiny, [PROMPT] * N_AR, GenerationConfig(
        max_new_tokens=NEW, stop_at_eos=False, sampling=seeded))
    ar_samples = [tuple(r.token_ids) for r in ar]
    assert_matches_exact(ar_samples, joint, f"ar {name}")
    samples, drafted, accepted = static_samples(tiny, cfg, N_STATIC)
    assert drafted > N_STATIC and 0 < accepted < drafted  # speculation really ran and rejected
    assert_matches_exact(samples, joint, f"static {name}")


def test_static_sampling_with_confidence_exit(tiny):
    cfg = SCENARIOS["t1"]
    samples, drafted, _ = static_samples(tiny, cfg, 300, tau=0.7)
    assert drafted > 0
    assert_matches_exact(samples, exact_distribution(tiny, cfg), "static tau=0.7")


def test_always_disagreeing_draft_still_gives_target(tiny, monkeypatch):
    """The draft distribution is a point mass on the token the draft thinks least likely:
    nearly every draft is rejected, and the output is still exactly the target's."""
    real = selfspec.probabilities

    def point_mass_on_least_likely(logits, cfg):
        q = torch.zeros_like(real(logits, cfg))
        q[..., int(logits.argmin())] = 1.0
        return q

    monkeypatch.setattr(selfspec, "probabilities", point_mass_on_least_likely)
    cfg = SCENARIOS["t1"]
    samples, drafted, accepted = static_samples(tiny, cfg, N_STATIC)
    assert drafted > N_STATIC and accepted / drafted < 0.3
    assert_matches_exact(samples, exact_distribution(tiny, cfg), "disagreeing draft")
