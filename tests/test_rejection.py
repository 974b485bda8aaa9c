"""Rejection sampling (``--sampling rejection``): every emitted token is distributed as the full
model's warped distribution p, drafts are accepted with probability 1 - TV(p, q), and the draws
are a pure function of the seed.

The unit tests build p and q by hand at a vocabulary of a few hundred and draw with many
distinct row seeds; the tokens of each branch (accepted draft, residual after a rejection,
bonus after full acceptance) are checked by chi-square against the exact warped p
(``tests/test_sampling.py``'s test, at significance 1e-3 with deterministic seeds).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from knapspec_dist.cli.job import config_from_args
from knapspec_dist.cli.main import parser
from knapspec_dist.engine import rejection
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.rejection import ACCEPT, RESIDUAL, accept_rejection
from knapspec_dist.engine.sampling import SamplingConfig, choose, gumbel, probabilities, uniform
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.errors import UserError
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
)

V, G = 300, 2  # vocabulary, drafts per round
GEN = torch.Generator().manual_seed(7)
TARGET = 2.0 * torch.randn(G + 1, V, generator=GEN)  # p at the two drafts and the bonus
NEAR = TARGET[:G] + 0.7 * torch.randn(G, V, generator=GEN)  # a draft close to p
FAR = -TARGET[:G]  # a draft that puts its mass where p has least
CONFIGS = {"t1": SamplingConfig(temperature=1.0, method="rejection"),
           "t0.8-k200-p0.95": SamplingConfig(temperature=0.8, top_k=200, top_p=0.95,
                                             method="rejection")}
N = 24_000  # rows, each its own seed
CHUNK = 6_000


def draw(draft_logits: torch.Tensor, cfg: SamplingConfig, seed: int = 1, rows: int = N
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` rows' round: drafts sampled from q with the rows' noise, then
    ``accept_rejection`` against TARGET. The drafts [rows, G], kept counts [rows] and next
    tokens [rows]."""
    seeds = seeds_of(rows, seed=seed)
    start = torch.full((rows,), 5, dtype=torch.int64)
    out = []
    for lo in range(0, rows, CHUNK):
        s, t = seeds[lo:lo + CHUNK], start[lo:lo + CHUNK]
        q = draft_logits[None].expand(len(s), G, V)
        drafts = torch.stack([choose(q[:, i], cfg, s, t + i) for i in range(G)], dim=1)
        n, nxt = accept_rejection(drafts, q, TARGET[None].expand(len(s), G + 1, V), cfg, s, t)
        out.append((drafts, n, nxt))
    return tuple(torch.cat(x) for x in zip(*out))


def exact(logits: torch.Tensor, cfg: SamplingConfig) -> dict[int, float]:
    """p by transformers' warpers."""
    p = hf_probs(logits[None], cfg)[0].double()
    return {i: float(x) for i, x in enumerate(p) if x > 0}


def emitted(drafts: torch.Tensor, n: torch.Tensor, nxt: torch.Tensor, j: int) -> list[int]:
    """The token each row emits at round position ``j``, for the rows that reach it."""
    return [int(drafts[r, j]) if n[r] > j else int(nxt[r]) for r in range(len(n)) if n[r] >= j]


def one_minus_tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.minimum(a.double(), b.double()).sum())


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("draft", ["near", "far"])
def test_every_emitted_token_is_distributed_as_p(name, draft):
    """At each round position the emitted token (accepted draft, residual draw after a
    rejection, or the bonus after both drafts are kept) fits the exact warped p; so do the
    residual draws alone, given a rejection at position 0 (p's share where q falls short);
    drafts are accepted at the rate 1 - TV(p, q)."""
    cfg = CONFIGS[name]
    q_logits = NEAR if draft == "near" else FAR
    drafts, n, nxt = draw(q_logits, cfg)
    for j in range(G + 1 if draft == "near" else 1):  # a far draft is rarely kept
        tokens = emitted(drafts, n, nxt, j)
        assert len(tokens) > 500, (j, len(tokens))
        assert_fits(tokens, exact(TARGET[j], cfg), f"{name} {draft}: position {j}")
    p, q = probabilities(TARGET[0][None], cfg)[0], probabilities(q_logits[0][None], cfg)[0]
    residual = (p.double() - q.double()).clamp(min=0)
    residual /= residual.sum()
    rejected = [int(nxt[r]) for r in range(N) if n[r] == 0]
    assert_fits(rejected, {i: float(x) for i, x in enumerate(residual) if x > 0},
                f"{name} {draft}: residual draws")
    alpha = one_minus_tv(p, q)
    rate = float((n > 0).double().mean())
    assert abs(rate - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / N) + 1e-3, (rate, alpha)
    if draft == "far":
        assert alpha < 0.2  # the residual branch is most of the draws here


def test_the_coupled_accept_would_fail_these_checks():
    """The checks above can fail: drafts judged by the coupling instead are accepted less
    often than 1 - TV, by more than the tolerance (so the rate check tells them apart)."""
    cfg = CONFIGS["t1"]
    seeds, start = seeds_of(N, seed=1), torch.full((N,), 5, dtype=torch.int64)
    coupled = (choose(NEAR[0].expand(N, V), cfg, seeds, start)
               == choose(TARGET[0].expand(N, V), cfg, seeds, start)).double().mean()
    p, q = probabilities(TARGET[0][None], cfg)[0], probabilities(NEAR[0][None], cfg)[0]
    alpha = one_minus_tv(p, q)
    assert alpha - float(coupled) > 8 * math.sqrt(alpha * (1 - alpha) / N)


def test_replacing_the_residual_by_p_is_detected(monkeypatch):
    """A residual drawn from p instead (a common mistake) puts too much mass where q is large:
    position 0's tokens no longer fit p."""
    real = rejection._at
    monkeypatch.setattr(rejection, "_at", lambda x, i: real(x, i) if x.shape[1] == G + 1
                        else torch.zeros_like(real(x, i)))  # q's row zero: residual = p
    cfg = CONFIGS["t1"]
    drafts, n, nxt = draw(FAR, cfg)
    with pytest.raises(AssertionError):
        assert_fits(emitted(drafts, n, nxt, 0), exact(TARGET[0], cfg), "residual = p")


def test_the_draws_are_a_pure_function_of_the_seed():
    """Same seeds: the same drafts, kept counts and tokens; other seeds: other draws. The
    acceptance uniforms and the residual noise are their own streams, not the choices'."""
    cfg = CONFIGS["t0.8-k200-p0.95"]
    rows = CHUNK // 4  # purity needs no statistics: enough rows for every branch
    first, again = draw(NEAR, cfg, rows=rows), draw(NEAR, cfg, rows=rows)
    other = draw(NEAR, cfg, seed=2, rows=rows)
    assert set(first[1].tolist()) == set(range(G + 1))  # residuals and bonus tokens drawn
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[2], other[2])
    seeds, index = seeds_of(64), torch.arange(6).expand(64, 6)
    u = uniform(seeds, index, ACCEPT)
    assert ((u > 0) & (u < 1)).all() and torch.equal(u, uniform(seeds, index, ACCEPT))
    assert not torch.equal(u, uniform(seeds, index, RESIDUAL))
    assert not torch.equal(gumbel(seeds, index, 50, RESIDUAL), gumbel(seeds, index, 50))


def test_greedy_is_unaffected():
    """Temperature 0: the target's argmax, as coupled acceptance gives it."""
    cfg = SamplingConfig(method="rejection")
    drafts = TARGET[:G].argmax(-1).expand(3, G).clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V
    q = NEAR[None].expand(3, G, V)
    n, nxt = accept_rejection(drafts, q, TARGET[None].expand(3, G + 1, V), cfg, None, None)
    assert n.tolist() == [2, 1, 2] and nxt.tolist() == [int(TARGET[2].argmax()),
                                                        int(TARGET[1].argmax()),
                                                        int(TARGET[2].argmax())]


def test_an_unknown_method_is_a_user_error():
    with pytest.raises(UserError, match="sampling must be one of"):
        SamplingConfig(temperature=1.0, method="typical")


def test_the_option_reaches_every_command_and_the_job_fingerprint():
    """``--sampling`` of generate, bench, throughput and job lands in the SamplingConfig; a
    job's fingerprint names it only when it is not the default (earlier outputs resume)."""
    common = ["--temperature", "0.7", "--sampling", "rejection"]
    p = parser()
    for argv in (["generate", "--prompt", "x"], ["bench", "--out", "o"],
                 ["throughput", "--out", "o"]):
        assert p.parse_args(argv + common).sampling == "rejection"
        assert p.parse_args(argv).sampling == "coupled"
    job = p.parse_args(["job", "--input", "i", "--output", "o"] + common)
    c = config_from_args(job)
    assert c.generation_config().sampling.method == "rejection"
    assert c.fingerprint()["sampling"] == "rejection"
    plain = config_from_args(p.parse_args(["job", "--input", "i", "--output", "o"]))
    assert plain.generation_config().sampling.method == "coupled"
    assert "sampling" not in plain.fingerprint()


# --------------------------------------------------------------------------- end to end

N_ROWS = 800


def rejection_samples(model, cfg: SamplingConfig, seed: int = 10_000
                      ) -> tuple[list[tuple[int, ...]], int, int]:
    """N_ROWS rows of one batched static speculation call, each with its own row seed."""
    strategy = SelfSpeculative(StaticSelector(frozenset({2, 5}), 3), tau_conf=0.0)
    c = GenerationConfig(max_new_tokens=NEW, stop_at_eos=False, sampling=SamplingConfig(
        cfg.temperature, cfg.top_k, cfg.top_p, seed=seed, method="rejection"))
    results = generate(strategy, model, [PROMPT] * N_ROWS, c, max_num_seqs=200)
    assert all(len(r.token_ids) == NEW for r in results)
    return ([tuple(r.token_ids) for r in results], sum(r.stats.drafted for r in results),
            sum(r.stats.accepted for r in results))


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0),
                                 SamplingConfig(temperature=0.9, top_k=6, top_p=0.9)],
                         ids=["t1", "t0.9-k6-p0.9"])
def test_speculation_with_rejection_sampling_fits_the_model(cfg, tiny):  # noqa: F811
    """Through the real round (drafts of a static subnet, one verify, rejection sampling):
    the first NEW tokens' single and adjacent-pair marginals fit the model's exact
    distribution, with drafts both accepted and rejected; the same seed gives the same
    tokens."""
    samples, drafted, accepted = rejection_samples(tiny, cfg)
    assert drafted > N_ROWS and 0 < accepted < drafted
    assert_matches_exact(samples, exact_distribution(tiny, cfg), "static, rejection")
    assert rejection_samples(tiny, cfg)[0] == samples


def test_rejection_sampling_is_not_plain_sampling_token_for_token(tiny):  # noqa: F811
    """What the option trades: the same seeds give tokens other than plain sampling's in
    some rows (the coupling's identity is gone), while greedy stays ar's."""
    cfg = SamplingConfig(temperature=1.0, seed=3)
    strategy = SelfSpeculative(StaticSelector(frozenset({2, 5}), 3), tau_conf=0.0)
    rows = [PROMPT] * 40
    plain = generate(Autoregressive(), tiny, rows, GenerationConfig(12, cfg, False))
    rej = generate(strategy, tiny, rows, GenerationConfig(
        12, SamplingConfig(1.0, seed=3, method="rejection"), False))
    assert Counter(a.token_ids == b.token_ids for a, b in zip(plain, rej))[False] > 0
    greedy = GenerationConfig(12, SamplingConfig(method="rejection"), False)
    assert ([r.token_ids for r in generate(strategy, tiny, rows[:2], greedy)]
            == [r.token_ids for r in generate(Autoregressive(), tiny, rows[:2], greedy)])
