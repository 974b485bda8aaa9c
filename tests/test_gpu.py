"""The GPU path: every strategy, the profiler and the bench on ``--device cuda``.

Every test runs once per device: ``cpu`` with the tiny random checkpoint (fast, part of the
normal suite), ``cuda`` with SmolLM2 (marked ``gpu``; skipped where no CUDA device exists, and
where SmolLM2 is not installed, saying so: scripts/gpu_pack.py brings it; run with
``pytest -m gpu``). The rules checked are docs/design.md's "Execution on GPUs":

* fp32: every strategy emits exactly ``ar``'s greedy tokens;
* bf16: a q-token verify and a 1-token decode may round differently, so a strategy may diverge
  from ``ar``, but only at a proven near-tie (tools/ties.py); a larger gap is a bug;
* sampling (temperature > 0, seeded) runs for every strategy and repeats with its seed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from knapspec_dist.cli.standalone import main
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.sampling import SamplingConfig
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.model.tokenizer import encode, load_tokenizer
from knapspec_dist.model.weights import load_model
from knapspec_dist.profiles.profiler import measure
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.speculation.options import StrategyOptions
from knapspec_dist.tools.corpus import document_of_tokens
from knapspec_dist.tools.gpucheck.correct import real_model
from knapspec_dist.tools.ties import TIE, check_divergence

from conftest import random_prompt
from synthetic import LINEAR_ATTENTION, synthetic_profile

log = logging.getLogger(__name__)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STRATEGIES = ["ar", "static", "knapspec", "clasp"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Target:
    """What one device runs: a checkpoint, a static skip list, prompts and lengths."""

    device: str
    path: Path
    skip: str  # the static strategy's skip list
    bench_static: str  # the same as a bench spec
    prompts: list[list[int]]
    new_tokens: int
    bench_context: int


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def target(request, checkpoints) -> Target:
    if request.param == "cpu":
        path = checkpoints["llama-gqa"]  # 4 layers, vocab 256, random weights
        prompts = [random_prompt(n, 256, seed) for seed, n in enumerate((20, 60, 120))]
        return Target("cpu", path, "a1,m2", "static:a1,m2@4", prompts, 24, 64)
    real = real_model(quick=False)  # SmolLM2, or why not (gpu-check's first line)
    if real.path is None:
        pytest.skip(real.headline())
    path = real.path
    tok = load_tokenizer(path)
    prompts = [encode(tok, document_of_tokens(tok, n)) for n in (256, 1000)]
    skip = "a10,a12,a14,a16,m11,m13"  # the bf16 tie setup of docs/gpu-measurements.md
    return Target("cuda", path, skip, f"static:{skip}@4", prompts, 64, 512)


@pytest.fixture(scope="module")
def models(target):
    cache = {}

    def get(dtype: str):
        if dtype not in cache:
            cache[dtype] = load_model(target.path, dtype=DTYPES[dtype], device=target.device)
        return cache[dtype]

    return get


def build(name: str, target: Target, model):
    """A strategy that really drafts: tau_conf 0, and for knapspec / clasp a profile pricing a
    full forward far above its sublayers (the random model's acceptance is low)."""
    options = {"ar": {}, "static": {"skip": target.skip, "gamma": 4},
               "knapspec": {"interval": 8}, "clasp": {"interval": 8, "gamma": 3}}[name]
    profiles = ([synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=100.0)]
                if name in ("knapspec", "clasp") else None)
    return build_strategy(StrategyOptions(name=name, tau_conf=0.0, **options), model, profiles)


def generate_named(name: str, target: Target, model, sampling: SamplingConfig | None = None):
    config = GenerationConfig(max_new_tokens=target.new_tokens, stop_at_eos=False,
                              sampling=sampling or SamplingConfig())
    return generate(build(name, target, model), model, target.prompts, config)


@pytest.mark.parametrize("name", STRATEGIES)
def test_fp32_every_strategy_equals_ar(target, models, name):
    model = models("fp32")
    expected = generate(Autoregressive(), model, target.prompts, GenerationConfig(
        max_new_tokens=target.new_tokens, stop_at_eos=False))
    results = generate_named(name, target, model)
    for prompt, got, want in zip(target.prompts, results, expected):
        assert got.token_ids == want.token_ids, check_divergence(
            model, prompt, want.token_ids, got.token_ids).describe()
    if name in ("static", "clasp"):
        assert sum(r.stats.drafted for r in results) > 0, "speculation never ran"


@pytest.mark.parametrize("name", STRATEGIES)
def test_bf16_divergences_from_ar_are_near_ties(target, models, name):
    model = models("bf16")
    expected = generate(Autoregressive(), model, target.prompts, GenerationConfig(
        max_new_tokens=target.new_tokens, stop_at_eos=False))
    results = generate_named(name, target, model)
    for prompt, got, want in zip(target.prompts, results, expected):
        assert len(got.token_ids) == target.new_tokens
        div = check_divergence(model, prompt, want.token_ids, got.token_ids)
        if div is not None:
            log.info("%s on %s: %s", name, target.device, div.describe())
            assert div.verdict == TIE, div.describe()
    if name == "ar":  # ar against itself: the same kernels, so no divergence at all
        assert all(r.token_ids == e.token_ids for r, e in zip(results, expected))


@pytest.mark.parametrize("name", STRATEGIES)
def test_sampling_runs_for_every_strategy(target, models, name):
    model = models("fp32")
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=11)
    first = generate_named(name, target, model, sampling)
    again = generate_named(name, target, model, sampling)
    vocab = model.cfg.vocab_size
    for r, s in zip(first, again):
        assert len(r.token_ids) == target.new_tokens
        assert all(0 <= t < vocab for t in r.token_ids)
        assert r.token_ids == s.token_ids  # the seed fixes the draw on the device too
    if name in ("static", "clasp"):
        assert sum(r.stats.drafted for r in first) > 0, "speculation never ran"


@pytest.fixture(scope="module")
def measured_profile(target, models):
    return measure(models("bf16"), [16, 64], batch=1, max_q=3, repeats=2)


def test_profiler_measures_on_the_device(target, measured_profile):
    p = measured_profile
    assert p.device["kind"] == target.device and p.dtype == "bf16"
    assert sorted(p.verify) == [1, 2, 3]
    assert p.mlp > 0 and p.head > 0 and p.attention_time(64) > 0
    s = p.samples
    times = [t for _, t in s["attention"]] + s["mlp"] + s["head"] + [t for *_, t in s["verify"]]
    assert all(0.0 < t < 5.0 for t in times)


def test_bench_runs_on_the_device(target, measured_profile, tmp_path, capsys):
    profile = tmp_path / "profile.json"
    measured_profile.save(profile)
    code = main(["bench", "--model", str(target.path), "--device", target.device,
                 "--dtype", "bf16", "--contexts", str(target.bench_context), "--prompts", "2",
                 "--strategies", f"ar,{target.bench_static},knapspec,clasp@3",
                 "--new-tokens", "16", "--tau-conf", "0", "--profile", str(profile),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["device"] == target.device and doc["bugs"] == 0
    assert len(doc["runs"]) == 2 * 4
    for r in doc["runs"]:
        assert r["stats"]["new_tokens"] == 16
        assert r["matches_ar"] == (r["divergence"] is None)
        if r["divergence"] is not None:
            assert r["divergence"]["verdict"] == TIE
    if target.device == "cuda":
        assert doc["machine"]["gpu"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "ERROR" not in md and "same tokens as ar" in md


@pytest.mark.parametrize("batch", [8, 32])
@pytest.mark.parametrize("name", ["ar", "knapspec"])
def test_batched_rows_match_batch_one_ar(target, models, name, batch):
    """Continuous batching at 8 and 32 rows of mixed lengths: each row's tokens are what it
    gets alone from batch-1 ar (exact in fp32 on the CPU; near-ties only in bf16 on CUDA)."""
    dtype = "fp32" if target.device == "cpu" else "bf16"
    model = models(dtype)
    vocab = model.cfg.vocab_size
    prompts = [random_prompt(16 + (37 * i) % 200, vocab, seed=500 + i) for i in range(batch + 3)]
    config = GenerationConfig(max_new_tokens=16, stop_at_eos=False)
    expected = generate(Autoregressive(), model, prompts, config, max_num_seqs=1)
    strategy = build(name, target, model)
    results = generate(strategy, model, prompts, config, max_num_seqs=batch)
    assert max(r.stats.mean_batch for r in results) > batch / 2
    for prompt, got, want in zip(prompts, results, expected):
        div = check_divergence(model, prompt, want.token_ids, got.token_ids)
        if div is not None:
            assert dtype == "bf16" and div.verdict == TIE, div.describe()
