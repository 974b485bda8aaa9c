"""The decoder against transformers' own LlamaForCausalLM / Qwen3ForCausalLM (fp32, CPU).

transformers is the numerical reference: logits, per-sublayer hidden states, incremental
decoding through the preallocated cache, and the skip-set semantics of the 2L sublayers.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.decoder import Capture, rope_frequencies
from knapspec_dist.model.forward_meta import forward_meta
from knapspec_dist.model.head import LMHead
from knapspec_dist.model.kernels import packed_linear
from knapspec_dist.model.kernels.packed_linear import (
    PackedGroup,
    PackedHead,
    PackedLinear,
    can_pack,
)
from knapspec_dist.model.weights import load_model

from conftest import CONFIG_NAMES, random_prompt

TOL = 1e-4
# Long enough that positions run past original_max_position_embeddings=256 of the llama3
# rope config, where llama3 scaling differs from plain rope.
SEQ = 300


def new_cache(model, batch: int = 1, capacity: int = SEQ + 8) -> KVCache:
    return KVCache(model.cfg, batch, capacity, dtype=model.dtype, device=model.device)


def one_shot(model, tokens: list[int], skip=frozenset(), capture=None) -> torch.Tensor:
    cache = new_cache(model, capacity=len(tokens) + 1)
    with torch.inference_mode():
        return model(torch.tensor([tokens]), cache.lengths[slice(0, 1)],
                     cache, skip=frozenset(skip), capture=capture)[0]


def test_test_configs_cover_the_required_shapes(engine_model):
    """GQA, Qwen3 head_dim != hidden/heads, tied and untied, llama3 rope, a sharded checkpoint."""
    cfgs = {n: engine_model(n).cfg for n in CONFIG_NAMES}
    assert any(c.num_kv_heads < c.num_heads for c in cfgs.values())
    q = cfgs["qwen3-headdim"]
    assert q.arch == "qwen3" and q.head_dim * q.num_heads != q.hidden_size
    assert {c.tie_word_embeddings for c in cfgs.values()} == {True, False}
    r = cfgs["llama-tied-llama3rope"].rope
    assert r["rope_type"] == "llama3" and r["original_max_position_embeddings"] < SEQ


def test_sharded_checkpoint_is_sharded(checkpoints):
    folder = checkpoints["llama-sharded"]
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_logits_match_transformers(name, engine_model, hf_reference):
    ours, ref = engine_model(name), hf_reference(name)
    tokens = random_prompt(SEQ, ours.cfg.vocab_size, seed=11)
    with torch.inference_mode():
        expected = ref(torch.tensor([tokens])).logits[0]
    got = one_shot(ours, tokens)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL


def test_llama3_rope_scaling_matters(engine_model):
    """Guard: the llama3 scaled frequencies differ from plain rope, so the test above can fail."""
    cfg = engine_model("llama-tied-llama3rope").cfg
    scaled, _ = rope_frequencies(cfg)
    plain, _ = rope_frequencies(replace(cfg, rope={"rope_type": "default",
                                                    "rope_theta": cfg.rope["rope_theta"]}))
    assert not torch.allclose(scaled, plain)


# SmolLM2's logits reach ~30 over 30 layers; our products (oneDNN,
# model/kernels/packed_linear.py) sum in another order than transformers' (MKL): 2e-4 apart
# at most on this prompt, 7e-6 relative.
SMOLLM2_TOL = 5e-4


def test_logits_match_transformers_smollm2(smollm2, smollm2_hf, corpus_prompt):
    tokens = corpus_prompt[:300]
    with torch.inference_mode():
        expected = smollm2_hf(torch.tensor([tokens])).logits[0]
    got = one_shot(smollm2.model, tokens)
    assert (got - expected).abs().max().item() <= SMOLLM2_TOL


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_sublayer_outputs_match_transformers(name, engine_model, hf_reference):
    """Hidden state after every sublayer (attention l, MLP l) equals transformers' at that point."""
    ours, ref = engine_model(name), hf_reference(name)
    tokens = random_prompt(40, ours.cfg.vocab_size, seed=12)
    attn_out: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.register_forward_hook(
        lambda mod, args, out, i=i: attn_out.__setitem__(i, out[0]))
        for i, layer in enumerate(ref.model.layers)]
    try:
        with torch.inference_mode():
            hf = ref(torch.tensor([tokens]), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    capture = Capture()
    one_shot(ours, tokens, capture=capture)
    L = ours.cfg.num_layers
    assert len(capture) == 2 * L + 1
    for layer in range(L):
        layer_in = hf.hidden_states[layer][0]
        assert (capture[2 * layer][0] - layer_in).abs().max() <= TOL
        after_attn = layer_in + attn_out[layer][0]
        assert (capture[2 * layer + 1][0] - after_attn).abs().max() <= TOL, f"attention {layer}"
        if layer + 1 < L:  # transformers' last hidden state is after the final norm
            assert (capture[2 * layer + 2][0] - hf.hidden_states[layer + 1][0]).abs().max() <= TOL


def manual_composition(model, tokens: list[int], skip: set[int]) -> torch.Tensor:
    """Call the sublayers one by one, leaving out those in ``skip`` (identity)."""
    cache = new_cache(model, capacity=len(tokens) + 1)
    with torch.inference_mode():
        meta = forward_meta(model, cache.lengths[0:1], len(tokens), cache, slice(0, 1))
        h = model.embed(torch.tensor([tokens]))
        for item in range(model.cfg.num_items):
            if item in skip:
                continue
            layer = model.layers[item // 2]
            h = layer.attention(h, meta, cache, item // 2) if item % 2 == 0 else layer.mlp(h)
        return model.logits(h)[0]


SKIP_SETS = [set(), {0}, {1}, {0, 1}, {2, 5}, {1, 3, 5}, {0, 2, 4}, {3, 4, 5, 6, 7}]


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-headdim"])
def test_each_sublayer_callable_and_skip_is_identity(name, engine_model):
    model = engine_model(name)
    tokens = random_prompt(24, model.cfg.vocab_size, seed=13)
    full = one_shot(model, tokens)
    for skip in SKIP_SETS:
        skip = {i for i in skip if i < model.cfg.num_items}
        got = one_shot(model, tokens, skip=skip)
        want = manual_composition(model, tokens, skip)
        assert torch.equal(got, want), skip
        if skip:  # the skip set really changes the network
            assert (got - full).abs().max() > 1e-3, skip
    # Skipping every sublayer leaves embedding -> final norm -> lm_head.
    everything = set(range(model.cfg.num_items))
    with torch.inference_mode():
        direct = model.logits(model.embed(torch.tensor([tokens])))[0]
    assert torch.equal(one_shot(model, tokens, skip=everything), direct)


def test_single_sublayer_is_residual_of_its_function(engine_model, hf_reference):
    """MLP l alone is h + mlp(post_attention_layernorm(h)) with transformers' module."""
    model, ref = engine_model("llama-gqa"), hf_reference("llama-gqa")
    h = torch.randn(2, 5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for layer in range(model.cfg.num_layers):
            hf_layer = ref.model.layers[layer]
            want = h + hf_layer.mlp(hf_layer.post_attention_layernorm(h))
            # a few fp32 ulps of the largest value (|h| reaches ~20 here)
            assert (model.layers[layer].mlp(h) - want).abs().max() <= 2e-6 * want.abs().max()


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_prefill_then_incremental_equals_one_shot(name, engine_model):
    model = engine_model(name)
    tokens = random_prompt(SEQ, model.cfg.vocab_size, seed=14)
    full = one_shot(model, tokens)
    cache = new_cache(model)
    rows = slice(0, 1)
    pieces = [tokens[:250], *[[t] for t in tokens[250:270]], tokens[270:273], tokens[273:]]
    got = []
    with torch.inference_mode():
        for piece in pieces:
            pos = cache.lengths[rows]
            got.append(model(torch.tensor([piece]), pos, cache)[0])
            cache.commit(0, cache.lengths[0] + len(piece))
    got = torch.cat(got)
    assert (got - full).abs().max().item() <= TOL
    assert torch.equal(got.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-headdim", "llama-tied-llama3rope"])
def test_batched_rows_at_different_positions(name, engine_model):
    """Padding-free batch: rows prefilled to different lengths, then decoded together."""
    model = engine_model(name)
    vocab = model.cfg.vocab_size
    seqs = [random_prompt(n, vocab, seed=20 + n) for n in (30, 51, 277)]
    extra = 4
    full = [one_shot(model, s) for s in seqs]
    cache = new_cache(model, batch=len(seqs), capacity=300)
    with torch.inference_mode():
        for b, s in enumerate(seqs):  # prefill each row alone, all but the last `extra` tokens
            rows = slice(b, b + 1)
            model(torch.tensor([s[:-extra]]), cache.lengths[rows],
                  cache, rows)
            cache.commit(b, len(s) - extra)
        everyone = slice(0, len(seqs))
        for j in range(extra - 2):  # one token per row per forward, rows at different positions
            tok = torch.tensor([[s[-extra + j]] for s in seqs])
            logits = model(tok, cache.lengths[everyone], cache, everyone)
            for b in range(len(seqs)):
                assert (logits[b, 0] - full[b][len(seqs[b]) - extra + j]).abs().max() <= TOL
                cache.commit(b, cache.lengths[b] + 1)
        tok = torch.tensor([s[-2:] for s in seqs])  # two tokens per row at once
        logits = model(tok, cache.lengths[everyone], cache, everyone)
        for b in range(len(seqs)):
            assert (logits[b] - full[b][-2:]).abs().max() <= TOL


def test_a_cpu_model_runs_its_products_through_packed_weights(engine_model):
    """Loaded on a CPU, q, k, v and gate, up are one PackedGroup each, the output products
    PackedLinear, the fp32 head PackedHead; their products are nn.Linear's (to fp32
    rounding), bias included; the parameters stay readable and are not held twice."""
    model = engine_model("llama-gqa")
    assert can_pack(model.device, model.dtype)
    for layer in model.layers:
        for block in (layer.attention, layer.mlp):
            assert type(block.merged) is PackedGroup
            assert not [m for m in block.children() if isinstance(m, nn.Linear)]
        assert type(layer.attention.o_proj) is PackedLinear
        assert type(layer.mlp.down_proj) is PackedLinear
    assert type(model.lm_head) is PackedHead
    o = model.layers[0].attention.o_proj
    assert o.weight.shape == (o.out_features, o.in_features)
    assert not any(p.shape == o.weight.shape for p in model.parameters())  # not held twice
    gen = torch.Generator().manual_seed(0)
    plain = nn.Linear(24, 40, bias=True)
    with torch.no_grad():
        plain.bias.normal_(generator=gen)
    x = torch.randn(3, 7, 24, generator=gen)
    for linear in (plain, nn.Linear(24, 40, bias=False)):
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(PackedLinear(linear).weight, linear.weight)
    other = nn.Linear(24, 8, bias=True)
    parts = PackedGroup(torch.cat([plain.weight, other.weight]).detach(),
                        torch.cat([plain.bias, other.bias]).detach(), [40, 8])(x)
    assert [p.shape for p in parts] == [(3, 7, 40), (3, 7, 8)]
    for part, linear in zip(parts, (plain, other)):
        torch.testing.assert_close(part, linear(x), rtol=1e-5, atol=1e-5)


def test_the_packed_head_follows_an_edit_of_its_weight():
    """Edited in place (a test building a tie), the head is packed again before its next use."""
    plain = nn.Linear(16, 8, bias=False)
    head = PackedHead(plain)
    x = torch.randn(2, 16)
    with torch.no_grad():
        plain.weight[3] = plain.weight[5]
    out = head(x)
    assert torch.equal(out[:, 3], out[:, 5])
    torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-5)


def test_packing_leaves_other_devices_and_dtypes_alone(monkeypatch):
    assert not can_pack(torch.device("cuda"), torch.float32)
    assert not can_pack(torch.device("cpu"), torch.float16)
    for bf16_path in (True, False):  # oneDNN's bf16 path: AVX-512 BW/VL/DQ, not AVX2 alone
        monkeypatch.setattr(packed_linear, "onednn_bf16", lambda: bf16_path)
        assert can_pack(torch.device("cpu"), torch.bfloat16) == (
            bf16_path and torch.backends.mkldnn.is_available())


@pytest.mark.parametrize("onednn_bf16", [True, False])
def test_a_bf16_model_keeps_its_fp32_head(checkpoints, monkeypatch, onednn_bf16):
    """The bf16 head sums in fp32 (head.py head_logits): it is not swapped. Where oneDNN has
    no bf16 path (an AVX2-only CPU: packing would raise), the products stay torch's linear."""
    if onednn_bf16 and not packed_linear.onednn_bf16():
        pytest.skip("oneDNN has no bf16 path on this CPU: packing bf16 weights would raise")
    monkeypatch.setattr(packed_linear, "onednn_bf16", lambda: onednn_bf16)
    model = load_model(checkpoints["llama-gqa"], dtype=torch.bfloat16, device="cpu")
    assert type(model.lm_head) is LMHead
    merged = model.layers[0].mlp.merged
    assert type(merged) is PackedGroup if onednn_bf16 else merged is None
    logits = model.logits(torch.randn(1, 2, model.cfg.hidden_size, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32
