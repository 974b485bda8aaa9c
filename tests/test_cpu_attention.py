"""Our CPU attention kernel over pages (model/kernels/paged_attention.py): its values against plain
attention in fp64, and the bit-for-bit properties the lossless check rests on (a verify of
T positions gives the bits of T decode steps; a row's result ignores the rows beside it and
the thread count)."""

import random

import pytest
import torch

from knapspec_dist.model.attention import attention_backend
from knapspec_dist.model.config import ModelConfig
from knapspec_dist.model.kernels.paged_attention import PAGE, paged_attention
from knapspec_dist.model.paged_cache import PagedKVCache

pytestmark = pytest.mark.usefixtures("cpu_build")  # each build this CPU executes


def pools(kv: int, pages: int, hd: int, seed: int = 0):
    """Random keys and values for a pool of ``pages`` pages: (keys by position [KV, P*16,
    hd], the same keys by dims [KV, pages, hd, 16], values [KV, P*16, hd])."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kv, pages * PAGE, hd, generator=g)
    v = torch.randn(kv, pages * PAGE, hd, generator=g)
    return k, k.view(kv, pages, PAGE, hd).transpose(2, 3).contiguous(), v


def tables(lengths: list[int], pages: int, seed: int = 0) -> torch.Tensor:
    """Each row's pages, drawn without repeats from pages 1.. in a shuffled order."""
    blocks = max(-(-n // PAGE) for n in lengths)
    order = list(range(1, pages))
    random.Random(seed).shuffle(order)
    return torch.tensor([order[b * blocks:(b + 1) * blocks] for b in range(len(lengths))])


def reference(q, k, v, table, starts):
    """Plain attention in fp64: q [B, H, T, hd] at positions starts[b] .. over each row's keys
    read through its pages -> [B, T, H*hd]."""
    b, h, t, hd = q.shape
    kv = k.shape[0]
    out = torch.empty(b, t, h * hd, dtype=torch.float64)
    for row in range(b):
        n = int(starts[row]) + t
        pos = torch.arange(n)
        idx = table[row, pos // PAGE] * PAGE + pos % PAGE
        keys = k[:, idx].double().repeat_interleave(h // kv, 0)  # [H, n, hd]
        vals = v[:, idx].double().repeat_interleave(h // kv, 0)
        scores = q[row].double() @ keys.transpose(1, 2) * hd ** -0.5  # [H, t, n]
        seen = pos[None, :] <= (int(starts[row]) + torch.arange(t))[:, None]
        scores = scores.masked_fill(~seen, float("-inf"))
        out[row] = (scores.softmax(-1) @ vals).transpose(0, 1).reshape(t, h * hd)
    return out


@pytest.mark.parametrize("heads,kv,hd", [(9, 3, 64), (4, 4, 16), (8, 2, 128)])
@pytest.mark.parametrize("case", ["prefill", "chunk", "decode", "verify"])
def test_the_kernel_matches_plain_attention(heads, kv, hd, case):
    t, starts = {"prefill": (45, [0, 0]), "chunk": (33, [16, 71]),
                 "decode": (1, [0, 17, 130]), "verify": (5, [3, 64, 250])}[case]
    lengths = [s + t for s in starts]
    pages = len(lengths) * (max(lengths) // PAGE + 1) + 1
    k, kt, v = pools(kv, pages, hd)
    table = tables(lengths, pages)
    q = torch.randn(len(starts), t, heads, hd).transpose(1, 2)  # the model's layout
    starts_t = torch.tensor(starts)
    got = paged_attention(q, kt, v, table, starts_t)
    want = reference(q, k, v, table, starts_t)
    assert got.shape == (len(starts), t, heads * hd)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_a_verify_gives_the_bits_of_its_decode_steps():
    heads, kv, hd, t = 9, 3, 64, 6
    starts = [40, 200, 511]
    pages = 3 * (600 // PAGE + 1) + 1
    _, kt, v = pools(kv, pages, hd, seed=1)
    table = tables([s + t for s in starts], pages, seed=1)
    q = torch.randn(3, heads, t, hd)
    verify = paged_attention(q, kt, v, table, torch.tensor(starts))
    for i in range(t):
        step = paged_attention(q[:, :, i:i + 1], kt, v, table, torch.tensor(starts) + i)
        assert torch.equal(step[:, 0], verify[:, i]), f"position {i}"


def test_a_rows_bits_ignore_its_neighbours_and_the_thread_count():
    heads, kv, hd, t = 9, 3, 64, 3
    starts = [0, 90, 300, 17]
    pages = 4 * (310 // PAGE + 1) + 1
    _, kt, v = pools(kv, pages, hd, seed=2)
    table = tables([s + t for s in starts], pages, seed=2)
    q = torch.randn(4, heads, t, hd)
    together = paged_attention(q, kt, v, table, torch.tensor(starts))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = paged_attention(q, kt, v, table, torch.tensor(starts))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for row in range(4):
        alone = paged_attention(q[row:row + 1], kt, v, table[row:row + 1],
                                torch.tensor(starts[row:row + 1]))
        assert torch.equal(alone[0], together[row]), f"row {row}"


def test_bf16_is_fp32_arithmetic_over_the_widened_values():
    """bf16 in and out: the fp32 kernel's result over the same (exactly widened) values,
    rounded once to bf16."""
    heads, kv, hd, t = 9, 3, 64, 4
    starts = [0, 37]
    pages = 2 * (50 // PAGE + 1) + 1
    _, kt, v = pools(kv, pages, hd, seed=3)
    kt, v = kt.bfloat16(), v.bfloat16()
    table = tables([s + t for s in starts], pages, seed=3)
    q = torch.randn(2, heads, t, hd).bfloat16()
    got = paged_attention(q, kt, v, table, torch.tensor(starts))
    want = paged_attention(q.float(), kt.float(), v.float(), table, torch.tensor(starts))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.bfloat16())


def test_mixed_or_other_dtypes_are_refused():
    _, kt, v = pools(1, 3, 16)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        paged_attention(torch.randn(1, 1, 1, 16).half(), kt.half(), v.half(),
                        torch.tensor([[1]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="fp32 or bf16"):
        paged_attention(torch.randn(1, 1, 1, 16), kt.bfloat16(), v.bfloat16(),
                        torch.tensor([[1]]), torch.tensor([0]))


def test_a_cache_by_dims_reads_back_what_a_cache_by_positions_holds():
    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=32, intermediate_size=8,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                      rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False,
                      attention_bias=False, mlp_bias=False,
                      rope={"rope_type": "default", "rope_theta": 1e4}, eos_token_ids=(0,))
    caches = [PagedKVCache(cfg, 2, 64, 9, PAGE, dtype=torch.float32, device="cpu",
                           key_layout=layout) for layout in ("positions", "dims")]
    k, v = torch.randn(2, 37, 1, 16), torch.randn(2, 37, 1, 16)

    class Meta:  # what write() reads of a ForwardMeta
        key_counts = gather = None

    for cache in caches:
        cache.assign(0, [5, 2, 7])
        cache.assign(1, [1, 3, 4])
        Meta.slots = cache.locate(slice(0, 2), torch.arange(37).repeat(2, 1), None)[0]
        cache.write(0, Meta, k, v)
    for row in range(2):
        a, b = caches[0].row_kv(0, row, 37), caches[1].row_kv(0, row, 37)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert torch.equal(a[0][0, :, :, :].transpose(0, 1), k[row])


def test_a_cpu_fp32_model_uses_the_kernel_and_others_do_not():
    class Model:
        backend, device, dtype = None, torch.device("cpu"), torch.float32

        class cfg:
            head_dim = 64

    assert attention_backend(Model) == "cpu"
    Model.dtype = torch.bfloat16
    assert attention_backend(Model) == "cpu"
    Model.dtype = torch.float16
    assert attention_backend(Model) == "sdpa"
    Model.dtype, Model.cfg.head_dim = torch.float32, 24
    assert attention_backend(Model) == "sdpa"
    Model.backend = "sdpa"
    assert attention_backend(Model) == "sdpa"


def test_indices_past_the_table_or_the_pool_are_refused_before_the_kernel_reads():
    _, kt, v = pools(1, 3, 16)
    q = torch.randn(1, 1, 2, 16)
    with pytest.raises(ValueError, match="outside"):  # positions 31..32 past 2 blocks of 16
        paged_attention(q, kt, v, torch.tensor([[1, 2]]), torch.tensor([31]))
    with pytest.raises(ValueError, match="outside"):  # page 3 of a 3-page pool
        paged_attention(q, kt, v, torch.tensor([[1, 3]]), torch.tensor([0]))
    assert paged_attention(q, kt, v, torch.tensor([[1, 2]]), torch.tensor([30])).shape \
        == (1, 2, 16)
