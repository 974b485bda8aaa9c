"""Latency profile: fits, queries, integer weights and the JSON round trip."""

from __future__ import annotations

import json

import pytest

from knapspec_dist.profiles import (
    LatencyProfile,
    LinearFit,
    fit_linear,
    fit_profile,
    integer_weights,
)

MODEL = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128,
         "vocab": 100}
META = {
    "device": {"name": "NVIDIA H200", "kind": "cuda", "threads": 16},
    "model": MODEL,
    "dtype": "bfloat16",
    "batch": 2,
    "tp": 2,
    "torch_version": "2.9.0",
    "created": "2026-01-02",
}


def synthetic_samples() -> dict:
    """Exact lines with a known slope/intercept, plus a noisy repeat for the medians."""
    return {
        "attention": [[n, 2e-8 * n + 1e-4] for n in (128, 512, 2048, 8192)],
        "mlp": [3e-4, 3e-4, 9e-4],  # one slow outlier: the median ignores it
        "head": [5e-4, 5e-4],
        "verify": [[q, n, q * 1e-5 + 1e-7 * n + 2e-3]
                   for q in (1, 4, 8) for n in (128, 1024, 4096)],
        "allreduce": [[b, 1e-9 * b + 2e-5] for b in (256, 1024, 4096)],
    }


def make_profile() -> LatencyProfile:
    return fit_profile(synthetic_samples(), **META)


def test_fit_linear_recovers_slope_and_intercept() -> None:
    fit = fit_linear([(x, 3.0 * x - 2.0) for x in range(10)])
    assert fit.slope == pytest.approx(3.0) and fit.intercept == pytest.approx(-2.0)
    assert fit_linear([(5.0, 7.0)]) == LinearFit(0.0, 7.0)
    assert fit_linear([(5.0, 6.0), (5.0, 8.0)]) == LinearFit(0.0, 7.0)
    assert fit(4) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        fit_linear([])


def test_fit_profile_recovers_known_coefficients() -> None:
    p = make_profile()
    assert p.attention.slope == pytest.approx(2e-8) and p.attention.intercept == pytest.approx(1e-4)
    assert p.mlp_time() == pytest.approx(3e-4)
    assert p.head == pytest.approx(5e-4)
    assert sorted(p.verify) == [1, 4, 8]
    assert p.verify[4].slope == pytest.approx(1e-7)
    assert p.verify[4].intercept == pytest.approx(4e-5 + 2e-3)
    assert p.allreduce == pytest.approx(1e-9 * (2 * 64 * 2) + 2e-5)  # batch * hidden * bf16 bytes
    single = fit_profile(synthetic_samples(), **{**META, "tp": 1})
    assert single.allreduce == 0.0


def test_verify_time_interpolates_and_clips() -> None:
    p = make_profile()
    exact = lambda q, n: q * 1e-5 + 1e-7 * n + 2e-3  # noqa: E731
    assert p.verify_time(4, 1000) == pytest.approx(exact(4, 1000))
    assert p.verify_time(6, 1000) == pytest.approx(exact(6, 1000))  # between 4 and 8: linear in q
    # clipped to the largest measured q
    assert p.verify_time(20, 1000) == pytest.approx(exact(8, 1000))
    assert p.verify_time(0, 1000) == pytest.approx(exact(1, 1000))


def test_draft_time_sums_executed_items_and_head() -> None:
    p = make_profile()
    n = 1000
    t_a, t_m = p.attention_time(n), p.mlp_time()
    assert p.draft_time(set(), n, 4) == pytest.approx(4 * (t_a + t_m) + p.head)
    assert p.draft_time({0, 3, 5}, n, 4) == pytest.approx(3 * t_a + 2 * t_m + p.head)


def test_integer_weights_normalize_and_cap() -> None:
    p = make_profile()
    assert integer_weights(p, 4000, 3) == [1, 2] * 3  # t_attn = 1.8e-4: ratio 1.67 -> 2
    # n = 100_000: t_attn = 2.1e-3 > t_mlp -> mlp 1, attention min(7, 5) = 5
    assert integer_weights(p, 100_000, 2) == [5, 1] * 2
    assert integer_weights(p, 100_000, 2, cap=3.0) == [3, 1] * 2
    # exact halves round up (not to even): 5 / 2 = 2.5 -> 3, attention is delta -> 1
    p.attention, p.mlp = LinearFit(0.0, 2.0), 5.0
    assert integer_weights(p, 10, 1) == [1, 3]
    # equal costs -> all ones
    p.attention = LinearFit(0.0, p.mlp)
    assert integer_weights(p, 10, 2) == [1, 1, 1, 1]
    p.mlp = 0.0
    with pytest.raises(ValueError):
        integer_weights(p, 10, 2)


def test_json_round_trip(tmp_path) -> None:
    p = make_profile()
    path = tmp_path / "profiles" / f"{p.key()}.json"
    p.save(path)
    q = LatencyProfile.load(path)
    assert q == p
    assert LatencyProfile.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert list(path.parent.iterdir()) == [path]  # no temp file left behind


def test_key_is_deterministic_and_file_name_safe() -> None:
    p = make_profile()
    key = p.key()
    assert key == make_profile().key()
    assert key == ("nvidia-h200"
                   "__layers4-hidden64-heads4-kv_heads2-head_dim16-intermediate128-vocab100"
                   "__bfloat16__b2__tp2__eager")
    other = fit_profile(synthetic_samples(), **{**META, "batch": 4})
    assert other.key() != key
    weird = fit_profile(synthetic_samples(), **{**META, "device": {"name": "AMD/Ryzen 9 (x86)"}})
    assert all(c.isalnum() or c in "._-" for c in weird.key())


def test_fit_profile_rejects_incomplete_input() -> None:
    with pytest.raises(ValueError):
        fit_profile({**synthetic_samples(), "mlp": []}, **META)
    with pytest.raises(ValueError):
        fit_profile(synthetic_samples(), **{k: v for k, v in META.items() if k != "tp"})


def test_attention_never_falls_below_the_fastest_measured() -> None:
    """A line fitted to noisy samples (a busy machine) can reach zero where it is extrapolated;
    integer_weights then refused the profile and a gpu-check row failed."""
    samples = {**synthetic_samples(), "attention": [[128, 3e-4], [512, 1e-4], [2048, 2e-4]]}
    p = fit_profile(samples, **META)
    assert p.attention(20000) < 0  # the fitted line, extrapolated
    assert p.attention_time(20000) == pytest.approx(1e-4)  # the fastest measured
    assert p.attention_time(128) == pytest.approx(p.attention(128))  # above it: the line
    assert integer_weights(p, 20000, 2)[:2] == [1, 3]  # raised "must be positive" before
