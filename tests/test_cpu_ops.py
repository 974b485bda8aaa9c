"""The one-pass element-wise kernels (model/kernels/elementwise.py), each build this CPU
executes: values against torch's eager ops (rotary bit for bit: the same IEEE products and
sums in the same order), a row's bits independent of the rows and threads beside it, and a
fused model against the plain one."""

import pytest
import torch
from test_model import one_shot

import knapspec_dist.model.weights as weights
from knapspec_dist.model.decoder import RMSNorm, apply_rotary, silu_and_mul
from knapspec_dist.model.forward_meta import ForwardMeta
from knapspec_dist.model.kernels import elementwise as cpu_ops

pytestmark = pytest.mark.usefixtures("cpu_build")  # each build this CPU executes
DTYPES = [torch.float32, torch.bfloat16]


def rand(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def ulps(dtype):  # one unit in the last place of values near 1, per dtype
    return {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 24, 100])
def test_rms_norm_matches_the_decoders_norm(dtype, dim):
    norm = RMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(dim, dtype=dtype, seed=1))
    x = rand(3, 5, dim, dtype=dtype, scale=3.0)
    want = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
            * norm.weight.double())
    got = cpu_ops.rms_norm(x, norm.weight, norm.eps)
    assert got.shape == x.shape and got.dtype == dtype
    # bf16 rounds the normalized row, then the product: two roundings of half an ulp each
    bound = 2 * ulps(dtype) * want.abs() + 1e-30
    assert ((got.double() - want).abs() <= bound).all()
    assert ((norm(x).double() - want).abs() <= bound).all()  # the reference bound holds for torch


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_a_strided_slice(dtype):
    x = rand(4, 9, 64, dtype=dtype)
    w = rand(64, dtype=dtype, seed=2)
    last = x[:, -1:]  # the head's input under last_only: rows far apart
    assert torch.equal(cpu_ops.rms_norm(last, w, 1e-6), cpu_ops.rms_norm(last.contiguous(), w,
                                                                          1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv,hd,tables", [(9, 3, 64, 2), (4, 2, 24, 2), (4, 2, 64, 1)])
def test_rotary_is_torchs_bit_for_bit(dtype, heads, kv, hd, tables):
    """tables=1: one row's tables for both rows (the DP's candidate states), broadcast."""
    b, t = 2, 7
    q, k = rand(b, t, heads, hd, dtype=dtype), rand(b, t, kv, hd, dtype=dtype, seed=1)
    angles = rand(tables, 1, t, hd, dtype=torch.float32, seed=2) * 40
    meta = ForwardMeta(torch.zeros(b), torch.zeros(b, t), angles.cos().to(dtype),
                       angles.sin().to(dtype), slice(0, b), t)
    want_q, want_k = apply_rotary(q.clone(), k.clone(), meta)
    got_q, got_k = cpu_ops.rotary(q, k, meta)
    assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_silu_times_up(dtype):
    gate = rand(6, 1536, dtype=dtype, scale=8.0)
    gate[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0]).to(dtype)  # both tails, both zeros
    up = rand(6, 1536, dtype=dtype, seed=1)
    g = gate.double()
    want = g * torch.sigmoid(g)
    if dtype == torch.bfloat16:  # silu rounded to bf16 first, as torch's two ops
        want = want.to(dtype).double()
    want = want * up.double()
    got = cpu_ops.silu_mul(gate, up).double()
    assert ((got - want).abs() <= 4 * ulps(dtype) * want.abs() + 1e-30).all()
    assert torch.allclose(got, silu_and_mul(gate, up).double(), rtol=4 * ulps(dtype), atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_ignore_the_rows_and_threads_beside_it(dtype):
    x = rand(40, 3000, dtype=dtype, scale=2.0)  # past the size where threads start
    w = rand(3000, dtype=dtype, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.silu_mul(x, w.expand(40, 3000))
        torch.set_num_threads(2)
        two = cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.silu_mul(x, w.expand(40, 3000))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    alone = torch.cat([cpu_ops.rms_norm(x[i:i + 1], w, 1e-5) for i in range(40)])
    assert torch.equal(alone, one[0])


def test_fused_model_matches_the_plain_one(checkpoints, monkeypatch):
    path = checkpoints["qwen3-headdim"]  # q/k norms and a head size that is no vector's
    fused = weights.load_model(path)
    monkeypatch.setattr(weights, "fuse_elementwise", lambda model: 0)
    plain = weights.load_model(path)
    assert type(fused.layers[0].attention.q_norm) is cpu_ops.CPURMSNorm
    assert type(fused.norm) is cpu_ops.CPURMSNorm and type(plain.norm) is RMSNorm
    assert fused.layers[0].mlp.gated is cpu_ops.silu_mul
    tokens = list(range(3, 60))
    assert torch.allclose(one_shot(fused, tokens), one_shot(plain, tokens), atol=1e-4, rtol=0)


def test_nothing_is_fused_where_the_kernels_do_not_run(checkpoints):
    model = weights.load_model(checkpoints["llama-gqa"], dtype=torch.float16)
    assert cpu_ops.fuse_elementwise(model) == 0 and type(model.norm) is RMSNorm
