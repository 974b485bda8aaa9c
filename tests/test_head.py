"""The vocabulary head returns fp32 logits summed in fp32 (model/head.py ``head_logits``):
in bf16 two tokens closer than a bf16 step no longer tie, and an fp32 model is unchanged. On
CUDA a half-precision head's product is cuBLAS' (model/kernels/cuda.py), chosen at load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from knapspec_dist.model import head as head_module
from knapspec_dist.model.head import LMHead, head_logits
from knapspec_dist.model.kernels import cuda as cuda_ops
from knapspec_dist.model.kernels.cuda import cublas_logits, head_product, use_cuda_kernels
from knapspec_dist.model.weights import load_model
from knapspec_dist.parallel.layers import VocabParallelLMHead, layout
from knapspec_dist.tools.ties import one_shot_logits

from conftest import random_prompt

BF16 = torch.bfloat16


def test_logits_closer_than_a_bf16_step_stay_apart():
    """20 and 20 + 2**-5 round to the same bf16 value (its step is 0.125 in [16, 32)); the
    head keeps them apart, so the argmax is the larger, not a tie."""
    x = torch.ones(1, 1, 4, dtype=BF16)
    weight = torch.tensor([[5.0, 5, 5, 5], [5, 5, 5, 5.03125], [1, 1, 1, 1]], dtype=BF16)
    assert torch.equal(F.linear(x, weight)[..., 0], F.linear(x, weight)[..., 1])  # bf16: a tie
    module = LMHead(4, 3, bias=False)
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    for z in (head_logits(x, weight), module(x)):
        assert z.dtype == torch.float32 and z[0, 0].tolist() == [20.0, 20.03125, 4.0]
        assert int(z[0, 0].argmax()) == 1


def test_bf16_model_logits_are_the_fp32_sum_of_bf16_operands(checkpoints):
    """The model's logits equal the product of its bf16 normed hidden state and bf16 head
    summed in fp64, to fp32 rounding (a bf16 output is off by up to 2**-9 of each logit)."""
    model = load_model(checkpoints["llama-gqa"], dtype=BF16, device="cpu")
    h = torch.randn(2, 5, model.cfg.hidden_size).to(BF16)
    with torch.inference_mode():
        got = model.logits(h)
        exact = F.linear(model.norm(h).double(), model.lm_head.weight.double())
    assert got.dtype == torch.float32
    rel = ((got.double() - exact).abs() / exact.abs().clamp(min=1.0)).max()
    assert rel < 1e-6, rel


def test_fp32_model_logits_are_bitwise_the_plain_linear(engine_model):
    model = engine_model("llama-gqa")
    h = torch.randn(2, 5, model.cfg.hidden_size)
    with torch.inference_mode():
        assert torch.equal(model.logits(h), F.linear(model.norm(h), model.lm_head.weight))


def test_cpu_head_upcasts_block_by_block_over_a_ragged_vocabulary(monkeypatch):
    """Blocks of 100 rows over a 256-token vocabulary (the last one short) give the fp32
    product of the upcast operands."""
    monkeypatch.setattr(head_module, "HEAD_ROWS", 100)
    torch.manual_seed(0)
    x, weight = torch.randn(3, 2, 16).to(BF16), torch.randn(256, 16).to(BF16)
    got = head_logits(x, weight)
    assert got.shape == (3, 2, 256)
    torch.testing.assert_close(got, F.linear(x.float(), weight.float()), rtol=1e-6, atol=1e-6)


class OneRank:
    """The collectives of a single rank: gathering is the identity."""

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_vocab_parallel_head_returns_fp32_logits(checkpoints):
    model = load_model(checkpoints["llama-gqa"], dtype=BF16, device="cpu")
    head = VocabParallelLMHead(layout(model.cfg, 0, 1), model.cfg.hidden_size, OneRank())
    head.weight = model.lm_head.weight
    x = model.norm(torch.randn(1, 3, model.cfg.hidden_size).to(BF16))
    with torch.inference_mode():
        got = head(x)
    assert got.dtype == torch.float32 and torch.equal(got, model.lm_head(x))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_generation_runs_on_the_fp32_head(checkpoints, dtype):
    """The head's output feeds generation in either dtype: a prefill's logits are fp32."""
    model = load_model(checkpoints["llama-gqa"], dtype=dtype, device="cpu")
    z = one_shot_logits(model, random_prompt(12, model.cfg.vocab_size, seed=0))
    assert z.dtype == torch.float32 and z.shape == (model.cfg.vocab_size,)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cublas_head_is_chosen_for_half_precision_on_cuda_alone():
    assert head_product("cuda", BF16) is cublas_logits
    assert head_product("cuda:0", torch.float16) is cublas_logits
    assert head_product("cuda", torch.float32) is None  # the plain fp32 product already
    assert head_product("cpu", BF16) is None  # no CPU build has mm(out_dtype=)


def test_a_cpu_model_keeps_the_portable_head(checkpoints):
    model = load_model(checkpoints["llama-gqa"], dtype=BF16, device="cpu")
    assert not use_cuda_kernels(model) and model.lm_head.product is head_logits


def test_loading_sets_the_devices_product_on_either_head(checkpoints, monkeypatch):
    """CUDA's choice emulated on a CPU: the product ``head_product`` names is what loading
    sets and what the model's logits then run, and the vocab-parallel head takes it too."""
    calls = []

    def product(x, weight):
        calls.append(x.shape)
        return head_logits(x, weight)

    monkeypatch.setattr(cuda_ops, "head_product", lambda device, dtype: product)
    model = load_model(checkpoints["llama-gqa"], dtype=BF16, device="cpu")
    assert model.lm_head.product is product
    with torch.inference_mode():
        model.logits(torch.randn(1, 3, model.cfg.hidden_size).to(BF16))
    assert calls == [(1, 3, model.cfg.hidden_size)]
    tp = SimpleNamespace(device="cuda", dtype=BF16, lm_head=VocabParallelLMHead(
        layout(model.cfg, 0, 1), model.cfg.hidden_size, OneRank()))
    monkeypatch.undo()
    assert use_cuda_kernels(tp) and tp.lm_head.product is cublas_logits


@pytest.mark.gpu
@CUDA
def test_cublas_head_sums_bf16_operands_in_fp32():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 64, device="cuda").to(BF16)
    weight = torch.randn(1000, 64, device="cuda").to(BF16)
    got = cublas_logits(x, weight)
    exact = F.linear(x.double(), weight.double())
    assert got.dtype == torch.float32 and got.shape == (3, 2, 1000)
    rel = ((got.double() - exact).abs() / exact.abs().clamp(min=1.0)).max()
    assert rel < 1e-6, rel
