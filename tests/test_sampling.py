"""Sampling is exact: Gumbel-max choice with each row's own noise yields the target
distribution, and speculation emits exactly the tokens plain sampling emits.

Statistical tests use fixed seeds (so they are deterministic) and a stated tolerance: a
chi-square goodness-of-fit test against the exact distribution must not reject at
significance ALPHA = 1e-3 (cells with expected count < 5 pooled), and, where stated, the
total-variation distance must stay under a bound several standard errors wide.

The reference for temperature / top-k / top-p is transformers' own logits warpers.
"""

from __future__ import annotations

import math

import pytest
import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.sampling import (
    G_MAX,
    SamplingConfig,
    accept,
    choose,
    confidence,
    gumbel,
    gumbel_of_bits,
    probabilities,
    row_seed,
    sample,
    sample_everywhere,
)
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.errors import UserError
from knapspec_dist.speculation import selfspec
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.selfspec import SelfSpeculative, StaticSelector

from distributions import (
    NEW,
    PROMPT,
    assert_fits,
    assert_matches_exact,
    exact_distribution,
    hf_probs,
    seeds_of,
    tv,
)

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


# --------------------------------------------------------------------------- noise and choice

V = 6
TARGET = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                       [-1.0, 0.0, 2.5, 0.3, 1.0, -2.0],
                       [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]])
CONFIGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3),
           SamplingConfig(temperature=1.2, top_p=0.8)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["t1", "t0.7-k3", "t1.2-p0.8"])
def test_choice_is_distributed_as_the_warped_target(cfg):
    """The Gumbel-max choice over N = 8000 row seeds fits transformers' warped distribution
    (chi-square at ALPHA, TV <= 0.03; a correct sampler's TV has expectation ~0.01 here), at
    two output indices (the noise of different indices is independent)."""
    n = 8000
    seeds = seeds_of(n)
    probs = hf_probs(TARGET[:1], cfg)[0]
    for step in (0, 7):
        tokens = choose(TARGET[:1].expand(n, V), cfg, seeds,
                        torch.full((n,), step, dtype=torch.int64)).tolist()
        expected = {i: float(probs[i]) for i in range(V)}
        assert_fits(tokens, expected, f"{cfg} step {step}")
        assert tv(tokens, expected) <= 0.03


def test_noise_is_a_pure_function_of_seed_index_and_token():
    seeds = seeds_of(3)
    index = torch.tensor([[0, 1], [5, 6], [0, 1]])
    g = gumbel(seeds, index, 50)
    assert torch.equal(g, gumbel(seeds, index, 50))
    assert torch.equal(g[1:2], gumbel(seeds[1:2], index[1:2], 50))  # batch-independent
    assert not torch.equal(g[0, 0], g[0, 1]) and not torch.equal(g[0], g[2])
    assert torch.isfinite(g).all()
    assert row_seed(7, "a") == row_seed(7, "a") != row_seed(7, "b") != row_seed(8, "a")


def test_noise_is_finite_at_the_extreme_hash_values():
    """The smallest and largest 52-bit values give u strictly inside (0, 1): finite noise,
    at most G_MAX (an infinite value would win whatever its token's logit)."""
    top = (1 << 52) - 1
    g = gumbel_of_bits(torch.tensor([0, 1, top - 1, top], dtype=torch.int64))
    assert torch.isfinite(g).all()
    assert g[-1] <= G_MAX and g[-1] > g[-2] > g[1] > g[0]  # distinct values, in order
    assert abs(float(g[-1]) - 52.0 * math.log(2)) < 1.0  # -log(-log(1 - 2^-53)) ~ 53 ln 2


def peaked_logits(vocab: int, nucleus: int, seed: int) -> torch.Tensor:
    """Logits whose top-p 0.9 nucleus is about ``nucleus`` tokens and whose tail spreads
    over the rest of a large vocabulary (a language model's shape)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) * 1.5
    head = torch.randperm(vocab, generator=gen)[:nucleus]
    logits[head] = 9.0 + torch.randn(nucleus, generator=gen)
    return logits


def sample_many(logits: torch.Tensor, cfg: SamplingConfig, n: int, chunk: int) -> torch.Tensor:
    """``n`` draws from one distribution, each with its own row seed, ``chunk`` rows a call."""
    out = []
    for lo in range(0, n, chunk):
        rows = min(chunk, n - lo)
        seeds = torch.tensor([row_seed(77, lo + i) for i in range(rows)], dtype=torch.int64)
        out.append(sample(logits[None, None].expand(rows, 1, -1), cfg, seeds,
                          torch.zeros(rows, 1, dtype=torch.int64))[:, 0])
    return torch.cat(out)


def test_sampling_at_a_152k_vocabulary_fits_the_warped_distribution():
    """Qwen3's vocabulary with top-p 0.9: 6,000 draws fit the exact nucleus distribution
    (chi-square at ALPHA), none outside it. A sampler that lets a uniformly random token win
    at 2^-24 per token (0.9 % of draws at this vocabulary, nearly all outside the nucleus:
    ~54 here) fails both; so does a leak of 0.3 % (~18 draws, none with probability 1e-7)."""
    vocab, n = 151_936, 6_000
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    logits = peaked_logits(vocab, 40, seed=3)
    probs = probabilities(logits[None], cfg)[0]
    support = {int(i): float(probs[i]) for i in torch.nonzero(probs).flatten()}
    tokens = sample_many(logits, cfg, n, chunk=500).tolist()
    outside = sum(1 for t in tokens if t not in support)
    assert outside == 0, f"{outside} of {n} draws outside the top-p support"
    assert_fits(tokens, support, "152k vocabulary, top-p 0.9")


@pytest.mark.e2e
def test_a_million_draws_stay_inside_the_support():
    """10^6 draws at a 512-token vocabulary, a third each with top-p, top-k and both: not one
    outside the support (a 2^-24-per-token leak gives ~30 here)."""
    vocab, n = 512, 340_000
    logits = peaked_logits(vocab, 30, seed=5)
    for cfg in (SamplingConfig(temperature=1.0, top_p=0.9), SamplingConfig(temperature=1.0,
                top_k=20), SamplingConfig(temperature=1.5, top_k=50, top_p=0.8)):
        allowed = probabilities(logits[None], cfg)[0] > 0
        tokens = sample_many(logits, cfg, n, chunk=68_000)
        assert bool(allowed[tokens].all()), f"{cfg}: {int((~allowed[tokens]).sum())} outside"
        assert len(set(tokens.tolist())) > 5  # it really samples


WIDE = [SamplingConfig(0.7, 0, 0.9), SamplingConfig(1.0, 0, 0.95), SamplingConfig(0.7, 40, 1.0),
        SamplingConfig(1.3, 100, 0.8), SamplingConfig(0.7, 2000, 0.95), SamplingConfig(0.5, 1, 1.0),
        SamplingConfig(1.0, 0, 1.0), SamplingConfig(0.7, 64, 1.0)]


@pytest.mark.parametrize("vocab", [50, 5000, 49_152])
def test_the_choice_among_candidates_is_the_whole_vocabulary_choice(vocab):
    """The candidate path (top logits only) gives the token the whole-vocabulary reference
    gives, at every position: peaked and flat rows, ties (inside the cut and at its edge),
    top-k wider than the candidates, top-p whose nucleus is wider than them."""
    gen = torch.Generator().manual_seed(vocab)
    rows, t = 6, 5
    logits = torch.randn(rows, t, vocab, generator=gen) * torch.tensor([1.0, 3.0, 8.0, 1.0, 3.0,
                                                                        8.0])[:, None, None]
    logits[1] += 6.0 * (torch.arange(vocab) < 20)  # a peaked row
    logits[0, 0, :70] = 4.0  # a tie that straddles 64 candidates
    logits[3, 2, :] = 0.0  # a flat row: every token ties
    logits[4, 1, 7:12] = logits[4, 1].max()  # a tie at the top
    seeds = torch.tensor([row_seed(3, i) for i in range(rows)], dtype=torch.int64)
    index = torch.arange(t).repeat(rows, 1) + 11
    for cfg in WIDE:
        want = sample_everywhere(logits, cfg, seeds, index)
        assert torch.equal(sample(logits, cfg, seeds, index), want), cfg


def test_confidence_is_the_top_probability():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4000, generator=gen) * 4
    logits[0, :3] += 12.0  # a small nucleus
    for cfg in WIDE[:6]:
        want = probabilities(logits, cfg).amax(dim=-1)
        assert torch.allclose(confidence(logits, cfg), want, rtol=1e-5, atol=1e-6), cfg


def test_sampled_drafts_are_accepted_exactly_where_the_target_samples_them():
    """Drafts from another distribution q, with the rows' noise: the emitted tokens are the
    tokens the target alone samples at those indices, whatever q is; acceptance happens (q
    close to p agrees often) and rejection happens (a far q)."""
    cfg = SamplingConfig(temperature=1.0)
    n, g = 2000, 2
    seeds = seeds_of(n, seed=99)
    start = torch.full((n,), 3, dtype=torch.int64)
    target = TARGET[None, :g + 1].expand(n, g + 1, V)
    alone = [choose(target[:, i], cfg, seeds, start + i) for i in range(g + 1)]
    for q, low, high in ((TARGET[:g] + 0.3 * torch.randn(g, V, generator=torch.Generator()
                          .manual_seed(0)), 0.5, 1.0), (-TARGET[:g], 0.0, 0.4)):
        drafts = torch.stack([choose(q[i].expand(n, V), cfg, seeds, start + i)
                              for i in range(g)], dim=1)
        k, nxt = accept(drafts, target, cfg, seeds, start)
        for row in range(n):
            kept = drafts[row, :k[row]].tolist() + [int(nxt[row])]
            assert kept == [int(alone[i][row]) for i in range(len(kept))]
        rate = float((k > 0).float().mean())
        assert low <= rate <= high, rate


# --------------------------------------------------------------------------- end to end

def static_samples(model, cfg: SamplingConfig, n: int, skip=frozenset({2, 5}), gamma=3,
                   tau=0.0) -> tuple[list[tuple[int, ...]], int, int]:
    """``n`` rows of one batched call: each row draws from its own generator (row_seed of the
    seed and its index), so the rows are independent samples, as ``n`` separate calls would
    be (test_sampled_speculation_is_plain_sampling_token_for_token: batched == alone)."""
    strategy = SelfSpeculative(StaticSelector(frozenset(skip), gamma), tau_conf=tau)
    c = GenerationConfig(max_new_tokens=NEW, stop_at_eos=False,
                         sampling=SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p,
                                                 seed=10_000))
    results = generate(strategy, model, [PROMPT] * n, c, max_num_seqs=min(n, 200))
    assert all(len(r.token_ids) == NEW for r in results)
    return ([tuple(r.token_ids) for r in results], sum(r.stats.drafted for r in results),
            sum(r.stats.accepted for r in results))


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
    """The draft proposes the token it thinks least likely: nearly every draft is rejected,
    and the output is still exactly the target's, token for token."""
    monkeypatch.setattr(selfspec, "choose", lambda logits, *_: logits.argmin(dim=-1))
    cfg = SCENARIOS["t1"]
    samples, drafted, accepted = static_samples(tiny, cfg, N_STATIC)
    assert drafted > N_STATIC and accepted / drafted < 0.3
    assert_matches_exact(samples, exact_distribution(tiny, cfg), "disagreeing draft")


def test_sampled_speculation_is_plain_sampling_token_for_token(tiny):
    """Seeded sampling: static speculation (accepting and rejecting) emits exactly ar's
    tokens, for every seed, batched or alone, and whatever else is in the batch."""
    cfg = SCENARIOS["t0.9-k6-p0.9"]
    strategy = SelfSpeculative(StaticSelector(frozenset({2, 5}), 3), tau_conf=0.0)
    others = [[1, 2, 3], PROMPT[::-1], [4] * 9]
    outputs = set()
    for seed in range(40):
        c = GenerationConfig(max_new_tokens=12, stop_at_eos=False, sampling=SamplingConfig(
            cfg.temperature, cfg.top_k, cfg.top_p, seed=seed))
        want = generate(Autoregressive(), tiny, [PROMPT], c)[0].token_ids
        assert generate(strategy, tiny, [PROMPT], c)[0].token_ids == want
        batched = generate(strategy, tiny, [others[0], PROMPT, *others[1:]], c, max_num_seqs=3)
        assert batched[1].token_ids == want
        outputs.add(tuple(want))
    assert len(outputs) > 20  # the seeds really differ
