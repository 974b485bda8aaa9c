"""Near-tie classification of greedy divergences from `ar` (tools/ties.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.model.precision import (
    BOUND_ULPS,
    FP32_CUDA_ULPS,
    TOKEN_IDENTICAL,
    guarantee,
    rule_ulps,
)
from knapspec_dist.model.weights import load_model
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.speculation.options import StrategyOptions
from knapspec_dist.tools import ties
from knapspec_dist.tools.ties import (
    BUG,
    TIE,
    check_divergence,
    check_run,
    classify,
    first_difference,
    inside_bound,
    one_shot_logits,
    reference_logits,
    spacing,
    tolerance,
)

from conftest import random_prompt

BF16 = torch.bfloat16
FP32 = torch.float32


def logits_with(values: dict[int, float], vocab: int = 16, rest: float = -3.0) -> torch.Tensor:
    z = torch.full((vocab,), rest)
    for i, v in values.items():
        z[i] = v
    return z


def next_bf16(x: float) -> float:
    """The next larger bf16 value after x (x > 0, representable), from its bits."""
    bits = torch.tensor([x], dtype=BF16).view(torch.int16)
    return float((bits + 1).view(BF16))


@pytest.mark.parametrize("x", [0.3, 1.0, 1.5, 7.9, 16.0, 19.75, 23.0, 31.9, 100.0])
def test_spacing_is_the_bf16_step(x):
    v = float(torch.tensor(x, dtype=BF16))
    assert spacing(v, BF16) == next_bf16(v) - v
    assert spacing(-v, BF16) == spacing(v, BF16)


def test_tolerance_is_the_tables_bf16_steps_and_zero_in_fp32():
    assert rule_ulps(BF16) == BOUND_ULPS[("bf16", "cpu")] == 14
    assert spacing(19.75, BF16) == 0.125
    assert tolerance(19.75, BF16) == 14 * 0.125
    assert tolerance(40.0, BF16) == 14 * 0.25
    assert tolerance(14.56, BF16) == 14 * 0.0625
    assert tolerance(19.75, torch.float16) == 14 * 2.0 ** (4 - 10)
    assert tolerance(19.75, torch.float32) == 0.0


@pytest.mark.parametrize("other", [19.75, 19.625, 18.0])  # 0, 1 and 14 bf16 steps below
def test_bf16_tie_within_tolerance(other):
    d = classify(logits_with({3: 19.75, 5: other}), 7, 3, 5, BF16)
    assert d.verdict == TIE and d.is_tie
    assert d.position == 7 and (d.reference_token, d.candidate_token) == (3, 5)
    assert d.top_token == 3 and d.gap == pytest.approx(19.75 - other) and d.tolerance == 1.75
    # the candidate may be the one-shot's top token: the gap is symmetric
    assert classify(logits_with({3: other, 5: 19.75}), 7, 3, 5, BF16).is_tie


@pytest.mark.parametrize("other", [17.875, 16.0, -3.0])  # 15 steps, 30 steps, far away
def test_bf16_gap_beyond_tolerance_is_a_bug(other):
    d = classify(logits_with({3: 19.75, 5: other}), 7, 3, 5, BF16)
    assert d.verdict == BUG and not d.is_tie and d.gap > d.tolerance
    assert "BUG" in d.describe()


def test_two_tokens_tied_below_a_third_are_a_bug():
    """Both tokens tie with each other, but the full model prefers a third one by far."""
    d = classify(logits_with({3: 19.75, 5: 19.75, 9: 22.0}), 0, 3, 5, BF16)
    assert d.verdict == BUG and d.top_token == 9 and d.gap == pytest.approx(2.25)


def test_fp32_rule_is_exact_identity():
    for other in (19.75, 19.75 - 1e-6, 19.0):
        d = classify(logits_with({3: 19.75, 5: other}), 2, 3, 5, torch.float32)
        assert d.verdict == BUG and d.tolerance == 0.0



def fp32_steps_below(x: float, k: int) -> float:
    """The fp32 value k representable steps below x (torch.nextafter, one step at a time)."""
    v = torch.tensor(x, dtype=FP32)
    for _ in range(k):
        v = torch.nextafter(v, torch.tensor(-math.inf, dtype=FP32))
    return float(v)


@pytest.mark.parametrize("x", [2.7, 16.0, 19.75, 35.8, 100.0])
def test_spacing_is_the_fp32_step(x):
    v = torch.tensor(x, dtype=FP32)
    up = torch.nextafter(v, torch.tensor(math.inf, dtype=FP32))
    assert spacing(float(v), FP32) == float(up) - float(v)


def test_fp32_rule_is_64_ulps_on_cuda_and_identity_elsewhere():
    assert rule_ulps(FP32, "cuda") == FP32_CUDA_ULPS == 64
    assert rule_ulps(FP32, torch.device("cuda", 1)) == 64
    assert rule_ulps(FP32, "cpu") == 0 and rule_ulps(torch.float64, "cuda") == 0
    assert rule_ulps(BF16, "cuda") == rule_ulps(BF16, "cpu") == 14
    # Worked: at 19.75 an fp32 ulp is 2**-19 (16 <= x < 32), so 64 ulps are 2**-13.
    assert tolerance(19.75, FP32, "cuda") == 2.0 ** -13 == 64 * (2.0 ** -19)
    assert tolerance(2.7, FP32, "cuda") == 64 * 2.0 ** -22  # 2 <= x < 4
    assert tolerance(19.75, FP32, "cpu") == 0.0
    assert tolerance(19.75, BF16, "cuda") == 1.75  # the CPU's bf16 value until measured


@pytest.mark.parametrize("steps,verdict", [(0, TIE), (1, TIE), (64, TIE), (65, BUG),
                                           (1000, BUG)])
def test_fp32_cuda_near_tie_counts_ulps_of_the_top_logit(steps, verdict):
    """Token 5 sits ``steps`` fp32 steps below the top logit 19.75 (token 3): a tie up to 64
    steps on CUDA, a bug beyond; on a CPU every fp32 divergence is a bug."""
    other = fp32_steps_below(19.75, steps)
    d = classify(logits_with({3: 19.75, 5: other}), 4, 3, 5, FP32, "cuda")
    assert d.gap == steps * 2.0 ** -19  # exact: both values lie in [16, 32)
    assert d.tolerance == 2.0 ** -13 and d.device == "cuda" and d.verdict == verdict
    assert "fp32 on cuda" in d.describe()
    assert classify(logits_with({3: 19.75, 5: other}), 4, 3, 5, FP32, "cpu").verdict == BUG


def test_fp32_cuda_tolerance_follows_the_largest_magnitude():
    """Just below 16 the steps halve, but the tolerance is taken at the top logit (16): 128
    steps of 2**-20 below 16 are 64 of its ulps, a tie; 129 are not."""
    assert classify(logits_with({3: 16.0, 5: fp32_steps_below(16.0, 128)}), 0, 3, 5, FP32,
                    "cuda").is_tie
    assert not classify(logits_with({3: 16.0, 5: fp32_steps_below(16.0, 129)}), 0, 3, 5, FP32,
                        "cuda").is_tie


def test_length_differences_are_bugs():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert first_difference([1, 2], [1, 2, 5]) == 2
    d = classify(torch.empty(0), 2, None, 5, BF16)
    assert d.verdict == BUG and d.gap is None and "lengths differ" in d.describe()


@pytest.fixture(scope="module")
def bf16_model(checkpoints):
    return load_model(checkpoints["llama-gqa"], dtype=BF16, device="cpu")


def test_one_shot_logits_equal_a_prefill_of_the_whole_sequence(engine_model):
    """The one-shot forward is the full model's next-token distribution: in fp32 its argmax is
    ar's next token at every step."""
    model = engine_model("llama-gqa")
    prompt = random_prompt(20, model.cfg.vocab_size, seed=1)
    ar = generate(Autoregressive(), model, [prompt], GenerationConfig(
        max_new_tokens=6, stop_at_eos=False))[0].token_ids
    for i, t in enumerate(ar):
        assert int(one_shot_logits(model, prompt + ar[:i]).argmax()) == t


def test_bf16_static_vs_ar_divergences_are_ties_and_corruption_is_a_bug(bf16_model):
    """Every divergence static meets in bf16 is a near-tie (whether one happens depends on the
    CPU's kernels: none is required), and ar's output corrupted with the least likely token is a
    BUG."""
    model = bf16_model
    config = GenerationConfig(max_new_tokens=32, stop_at_eos=False)
    static = build_strategy(StrategyOptions(name="static", skip="a1,m2", gamma=4, tau_conf=0.0),
                            model)
    for seed in range(8):
        prompt = random_prompt(40 + 30 * seed, model.cfg.vocab_size, seed=seed)
        ref = generate(Autoregressive(), model, [prompt], config)[0].token_ids
        res = generate(static, model, [prompt], config)[0]
        assert res.stats.drafted > 0, "speculation never ran"
        assert check_divergence(model, prompt, ref, ref) is None
        div = check_divergence(model, prompt, ref, res.token_ids)
        if div is not None:  # in bf16 a divergence may happen, but only at a near-tie
            assert div.verdict == TIE, div.describe()
        # Corrupt ar's output at token k with the full model's least likely token: a BUG.
        k = 5 + seed
        worst = int(one_shot_logits(model, prompt + ref[:k]).argmin())
        bad = ref[:k] + [worst] + ref[k + 1:]
        div = check_divergence(model, prompt, ref, bad)
        assert div.position == k and div.candidate_token == worst and div.verdict == BUG
        assert div.gap > 10 * div.tolerance > 0


def twin_head(checkpoints, dtype: torch.dtype, prompt: list[int]):
    """The test model with head row ``b`` set equal to row ``a``, where ``a`` is ar's first token
    after ``prompt``: there ``a`` and ``b`` tie exactly, whatever the kernels (one row, one dot
    product). Returns the model, ``a`` and ``b``."""
    model = load_model(checkpoints["llama-gqa"], dtype=dtype, device="cpu")
    a = int(one_shot_logits(model, prompt).argmax())
    b = (a + 7) % model.cfg.vocab_size
    with torch.no_grad():
        model.lm_head.weight[b] = model.lm_head.weight[a]
    return model, a, b


@pytest.mark.parametrize("dtype,verdict", [(BF16, TIE), (FP32, BUG)])
def test_a_tie_built_into_the_head_is_a_tie_in_bf16_and_a_bug_in_fp32(checkpoints, dtype,
                                                                      verdict):
    """Emitting the twin of ar's first token is a divergence at an exact tie (gap 0): a near-tie
    in bf16, a BUG in fp32 on a CPU (identity is the rule there)."""
    prompt = random_prompt(30, 256, seed=2)
    model, a, b = twin_head(checkpoints, dtype, prompt)
    z = one_shot_logits(model, prompt)
    assert z[a] == z[b] == z.max()
    config = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    ref = generate(Autoregressive(), model, [prompt], config)[0].token_ids
    assert ref[0] in (a, b)
    twin = b if ref[0] == a else a
    div = check_divergence(model, prompt, ref, [twin] + ref[1:])
    assert (div.position, div.reference_token, div.candidate_token) == (0, ref[0], twin)
    assert div.gap == 0.0 and div.verdict == verdict, div.describe()


def test_fp32_static_equals_ar(engine_model):
    """In fp32 the rule is identity: static's tokens equal ar's (check_divergence is None)."""
    model = engine_model("llama-gqa")
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    static = build_strategy(StrategyOptions(name="static", skip="a1,m2", gamma=4, tau_conf=0.0),
                            model)
    prompt = random_prompt(50, model.cfg.vocab_size, seed=4)
    ref = generate(Autoregressive(), model, [prompt], config)[0].token_ids
    assert check_divergence(model, prompt, ref, generate(static, model, [prompt], config)[0]
                            .token_ids) is None
    flipped = ref[:3] + [(ref[3] + 1) % model.cfg.vocab_size] + ref[4:]
    assert check_divergence(model, prompt, ref, flipped).verdict == BUG


def tie_logits(rows: int, ties: dict[int, tuple[int, int]], vocab: int = 16) -> torch.Tensor:
    """[rows, vocab] logits: token 2 on top at 19.75 everywhere, except that at row ``i`` of
    ``ties`` the pair (a, b) ties exactly at 19.75."""
    z = torch.full((rows, vocab), -3.0)
    z[:, 2] = 19.75
    for i, (a, b) in ties.items():
        z[i, 2] = -3.0
        z[i, a] = z[i, b] = 19.75
    return z


BF16_CPU = SimpleNamespace(dtype=BF16, device=torch.device("cpu"))


def test_check_run_goes_on_past_each_near_tie_teacher_forced():
    """Ties at tokens 2 and 5: after each, the candidate is generated again from the
    reference's token, and the comparison goes on to the end (2 ties, 2 reruns)."""
    reference = [2, 2, 3, 2, 2, 7, 2, 2]
    logits = tie_logits(8, {2: (3, 4), 5: (7, 9)})
    calls = []

    def rerun(ids: list[int], n: int) -> list[int]:
        calls.append((len(ids), n))
        start = len(ids) - 10
        return reference[3:5] + [9] + reference[6:] if start == 3 else reference[start:]

    candidate = [2, 2, 4, 2, 2, 2, 2, 2]  # ties at 2, then whatever its own prefix gave
    check = check_run(BF16_CPU, list(range(10)), reference, candidate, rerun, logits)
    assert [(d.position, d.reference_token, d.candidate_token) for d in check.divergences] == [
        (2, 3, 4), (5, 7, 9)]
    assert calls == [(13, 5), (16, 2)] and check.reruns == 2
    assert check.correct and check.ties == 2 and check.ties_per_1k == 250.0
    assert check.inside_bound == 2 and check.false_acceptance == 0.25  # the two exact ties


def test_check_run_finds_a_bug_after_a_near_tie():
    reference = [2, 2, 3, 2, 2, 2]
    logits = tie_logits(6, {2: (3, 4)})
    check = check_run(BF16_CPU, [0], reference, [2, 2, 4, 2, 2, 2],
                      lambda ids, n: [2, 5, 2][:n], logits)
    assert [d.verdict for d in check.divergences] == [TIE, BUG]
    assert check.divergences[1].position == 4 and not check.correct
    assert check.to_dict()["correct"] is False and check.to_dict()["divergences"][1]["gap"] > 22


def test_check_run_of_equal_tokens_has_no_divergence_and_no_rerun():
    logits = tie_logits(4, {})
    check = check_run(BF16_CPU, [0], [2] * 4, [2] * 4,
                      lambda ids, n: pytest.fail("reran"), logits)
    assert check.divergences == () and check.correct and check.ties_per_1k == 0.0


def test_inside_bound_counts_runner_ups_within_the_tolerance():
    """Gaps of 0, 1 and 14 bf16 steps at 19.75 are inside the 1.75 bound, 15 steps are not;
    in fp32 on a CPU nothing is (identity)."""
    z = torch.full((4, 8), -3.0)
    z[:, 0] = 19.75
    z[0, 1], z[1, 1], z[2, 1], z[3, 1] = 19.75, 19.625, 18.0, 17.875
    assert inside_bound(z, BF16) == 3
    assert inside_bound(z, FP32) == 0
    assert inside_bound(z, FP32, "cuda") == 1  # 0 ulps, the others are thousands of fp32 ulps


def test_reference_logits_are_the_one_shot_logits_at_every_position(engine_model, monkeypatch):
    """In fp32 the blocked forward of ar's tokens (blocks of 3 here) predicts ar's next token
    at every position, and agrees with a one-shot prefill of each prefix."""
    monkeypatch.setattr(ties, "BLOCK", 3)
    model = engine_model("llama-gqa")
    prompt = random_prompt(20, model.cfg.vocab_size, seed=3)
    ar = generate(Autoregressive(), model, [prompt], GenerationConfig(
        max_new_tokens=8, stop_at_eos=False))[0].token_ids
    logits = reference_logits(model, prompt, ar)
    assert logits.shape == (8, model.cfg.vocab_size) and logits.dtype == torch.float32
    assert logits.argmax(dim=-1).tolist() == ar
    for i in (0, 4, 7):
        torch.testing.assert_close(logits[i], one_shot_logits(model, prompt + ar[:i]),
                                   rtol=1e-4, atol=1e-4)  # fp32 rounding


def test_check_run_on_a_tie_built_into_the_head(checkpoints):
    """bf16, two equal head rows: the candidate emits the twin of ar's first token (an exact
    tie), then ar's own continuation from ar's token (whatever it is: prefill and decode may
    round differently, each divergence must be a near-tie); corrupted at token 5 afterwards,
    the check goes past the tie and finds the BUG."""
    prompt = random_prompt(30, 256, seed=2)
    model, a, b = twin_head(checkpoints, BF16, prompt)
    config = GenerationConfig(max_new_tokens=10, stop_at_eos=False)
    ref = generate(Autoregressive(), model, [prompt], config)[0].token_ids
    twin = b if ref[0] == a else a

    def ar_from(ids: list[int], n: int) -> list[int]:
        return generate(Autoregressive(), model, [ids], GenerationConfig(
            max_new_tokens=n, stop_at_eos=False))[0].token_ids

    check = check_run(model, prompt, ref, [twin] + ref[1:], ar_from)
    assert check.divergences[0].position == 0 and check.divergences[0].gap == 0.0
    assert check.correct, [d.describe() for d in check.divergences]
    assert check.reruns >= 1 and check.inside_bound >= 1  # position 0 at least

    logits = reference_logits(model, prompt, ref)
    worst = int(logits[5].argmin())
    corrupted = check_run(model, prompt, ref, [twin] + ref[1:],
                          lambda ids, n: (ref[1:5] + [worst] + ref[6:])[-n:], logits)
    assert [d.verdict for d in corrupted.divergences] == [TIE, BUG]
    assert corrupted.divergences[1].position == 5 and not corrupted.correct


def test_guarantee_names_what_the_rule_allows():
    """Identity where the rule tolerates nothing; near-ties, with dtype and device, elsewhere."""
    assert guarantee("fp32", "cpu") == guarantee(FP32) == TOKEN_IDENTICAL == "token-identical"
    assert guarantee(BF16, "cpu") == "identical up to near-ties (bf16 on cpu)"
    assert guarantee("bf16", torch.device("cuda", 0)) == "identical up to near-ties (bf16 on cuda)"
    assert guarantee("fp16", "cuda") == "identical up to near-ties (fp16 on cuda)"
    assert guarantee("fp32", "cuda") == "identical up to near-ties (fp32 on cuda)"


def test_logit_spread_is_the_uneven_error_over_the_top_tokens_in_ulps(monkeypatch):
    """Against constructed one-shot logits (top 19.75, a bf16 ulp of 0.125 there): a decode
    path off by +0.25 on the top token and -0.125 on the runner-up spreads 3 ulps; an error
    outside the top 2, or the same on every token, spreads none."""
    base = torch.full((4, 8), -3.0)
    base[:, 0], base[:, 1] = 19.75, 19.0
    decode = base.clone()
    decode[0, 0] += 0.25
    decode[0, 1] -= 0.125
    decode[1, 5] += 2.0  # outside the top 2
    decode[2] += 1.0  # even: no spread

    def path(model, prompts, tokens, q):
        return {ties.BLOCK: base, 1: decode, 2: base}[q][None]

    monkeypatch.setattr(ties, "_path_logits", path)
    spreads = {s.path: s for s in ties.logit_spread(BF16_CPU, [0], [1] * 4, qs=(2,), top=2)}
    assert spreads["decode"].max == 3.0 and spreads["decode"].positions == 4
    assert spreads["decode"].median == 0.0
    assert spreads["verify q=2"].max == 0.0


def test_batch_logit_spread_counts_every_rows_positions(monkeypatch):
    """Two rows decoded together: row 1's decode logits are off by +0.25 / -0.125 on its top
    two tokens at one position (3 ulps), row 0 is exact; the spread covers all 8 positions,
    each row measured against its own one-shot logits."""
    one = torch.full((2, 4, 8), -3.0)
    one[:, :, 0], one[:, :, 1] = 19.75, 19.0
    one[1, :, 3] = 19.5  # row 1's runner-up is another token
    decode = one.clone()
    decode[1, 2, 0] += 0.25
    decode[1, 2, 3] -= 0.125
    monkeypatch.setattr(ties, "reference_logits", lambda model, p, t: one[p[0]])
    monkeypatch.setattr(ties, "_path_logits",
                        lambda model, prompts, tokens, q: {1: decode, 5: one}[q])
    spreads = {s.path: s for s in ties.batch_logit_spread(
        BF16_CPU, [[0], [1]], [[1] * 4, [2] * 4], qs=(5,), top=2)}
    assert spreads["decode"].positions == 8 and spreads["decode"].max == 3.0
    assert spreads["verify q=5"].max == 0.0
    with pytest.raises(ValueError, match="as many tokens"):
        ties.batch_logit_spread(BF16_CPU, [[0], [1]], [[1] * 4, [2] * 3])


def test_rows_decoded_together_get_their_own_logits(engine_model):
    """fp32: rows of different prompt lengths, decoded and verified in one batch, get each
    row's own logits (those of the row alone, up to fp32 rounding), and the decode path's
    agree with the one-shot forward of each prefix."""
    model = engine_model("llama-gqa")
    vocab = model.cfg.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (9, 14, 20)]
    tokens = [random_prompt(6, vocab, seed=40 + n) for n in range(3)]
    for q in (1, 4):
        together = ties._path_logits(model, prompts, tokens, q)
        assert together.shape == (3, 6, vocab)
        for b in range(3):
            alone = ties._path_logits(model, [prompts[b]], [tokens[b]], q)[0]
            torch.testing.assert_close(together[b], alone, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(together[2, 3], one_shot_logits(model, prompts[2] + tokens[2][:3]),
                               rtol=1e-4, atol=1e-4)


def test_fp32_cpu_check_of_equal_tokens_runs_no_forward(monkeypatch):
    """Identity is the rule there: equal tokens need no one-shot logits (nor a false-acceptance
    count); a difference does."""
    monkeypatch.setattr(ties, "reference_logits", lambda *a: pytest.fail("forward"))
    cpu32 = SimpleNamespace(dtype=FP32, device=torch.device("cpu"))
    check = check_run(cpu32, [0], [2] * 4, [2] * 4, lambda ids, n: pytest.fail("reran"))
    assert check.correct and check.inside_bound == 0 and check.tokens == 4
    monkeypatch.setattr(ties, "reference_logits", lambda *a: tie_logits(4, {1: (2, 3)}))
    check = check_run(cpu32, [0], [2] * 4, [2, 3, 2, 2], lambda ids, n: pytest.fail("reran"))
    assert [d.verdict for d in check.divergences] == [BUG]  # an exact tie, but fp32 on a CPU
