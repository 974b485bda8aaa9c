"""Model shapes of the check and the byte arithmetic of a memory-bound decode step.

Pure functions (no device, no timing), so the bound the measurements are compared with is
tested on its own. A decode step reads every weight matrix once (the embedding table only
for the batch's rows, which is negligible and left out; a tied lm_head is the table, read in
full) and, per attention sublayer it runs, the K and V of every cached position of every row.
"""

from __future__ import annotations

from knapspec_dist.model.config import ModelConfig

H200_BANDWIDTH = 4.3e12  # bytes/s: copy bandwidth measured on an H200 (docs/gpu-measurements.md)
GIB = 1 << 30

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def llama(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
          head_dim: int, window: int = 131072, rope: dict | None = None) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=intermediate, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       max_position_embeddings=window, tie_word_embeddings=False,
                       attention_bias=False, mlp_bias=False,
                       rope=dict(rope or LLAMA3_ROPE), eos_token_ids=(128001,))


def llama31_8b() -> ModelConfig:
    return llama(128256, 4096, 14336, 32, 32, 8, 128)


def llama31_70b_shard(tp: int = 8) -> ModelConfig:
    """One GPU's shard of Llama-3.1-70B at tensor-parallel degree ``tp`` (no all-reduce)."""
    return llama(128256 // tp, 8192, 28672 // tp, 80, 64 // tp, max(1, 8 // tp), 128)


def tiny(kv_heads: int, layers: int = 8) -> ModelConfig:
    """A CPU-sized stand-in with the same structure (GQA, llama3 rope)."""
    return llama(512, 128, 256, layers, 4, kv_heads, 32)


def shapes(quick: bool) -> dict[str, ModelConfig]:
    if quick:
        return {"tiny-gqa": tiny(2), "tiny-kv1": tiny(1)}
    return {"llama31-8b": llama31_8b(), "llama31-70b-tp8": llama31_70b_shard(8)}


def decode_kernel(name: str, cfg: ModelConfig, backend: str) -> dict:
    """Which flex kernel serves this shape's decode and verify steps (T < 128 queries), as torch
    2.11's lowering chooses (``_use_flex_decoding``): flex-decoding, which splits the keys of
    a row over thread blocks (split-K), only when query heads / KV heads is a power of two;
    else the main flex kernel, one thread block per query block and (row, query head), with
    no split over the keys. So a shape with another ratio (SmolLM2: 9 / 3 = 3) says nothing
    about long-context decoding of one with a power of two (Llama-3.1-70B: 64 / 8 = 8)."""
    group = cfg.num_heads // cfg.num_kv_heads
    power_of_two = group > 0 and group & (group - 1) == 0
    ratio = f"{cfg.num_heads} query heads / {cfg.num_kv_heads} KV heads = {group}"
    if power_of_two:
        flex = "flex-decoding"
        line = f"{name}: {ratio}, a power of two: flex-decoding (split-K over the keys)"
    else:
        flex = "flex main kernel"
        line = (f"{name}: {ratio}, not a power of two: the main flex kernel, no split-K; its "
                "long-context figures are not those of a power-of-two model (Llama-3.1-70B: "
                "64 / 8 = 8)")
    kernel = flex if backend == "flex" else backend
    if backend != "flex":
        line = f"{line}; attention runs {backend} here, so this holds on CUDA only"
    return {"model": name, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "group": group, "power_of_two": power_of_two, "backend": backend,
            "decode_kernel": kernel, "flex_kernel": flex, "line": line}


def attention_weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    hd, h = cfg.head_dim, cfg.hidden_size
    params = h * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + h  # q, k, v, o and the norm
    return params * dtype_bytes


def mlp_weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    return (3 * cfg.hidden_size * cfg.intermediate_size + cfg.hidden_size) * dtype_bytes


def head_weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """lm_head and the final norm (the embedding rows a step reads are left out)."""
    return (cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) * dtype_bytes


def weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of weights a full decode step reads."""
    per_layer = attention_weight_bytes(cfg, dtype_bytes) + mlp_weight_bytes(cfg, dtype_bytes)
    return cfg.num_layers * per_layer + head_weight_bytes(cfg, dtype_bytes)


def resident_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of every parameter in memory (the read ones plus an untied embedding table)."""
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * dtype_bytes
    return weight_bytes(cfg, dtype_bytes) + embed


def kv_bytes_per_layer(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """K and V of ``tokens`` cached positions (summed over rows) in one layer."""
    return 2 * cfg.num_kv_heads * cfg.head_dim * tokens * dtype_bytes


def kv_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    return cfg.num_layers * kv_bytes_per_layer(cfg, tokens, dtype_bytes)


def step_bytes(cfg: ModelConfig, batch: int, context: int, dtype_bytes: int,
               skip: frozenset[int] = frozenset()) -> int:
    """Bytes one forward of one token per row reads at ``context``, skipping ``skip`` items."""
    attn = attention_weight_bytes(cfg, dtype_bytes) + kv_bytes_per_layer(
        cfg, batch * context, dtype_bytes)
    mlp = mlp_weight_bytes(cfg, dtype_bytes)
    total = head_weight_bytes(cfg, dtype_bytes)
    for item in range(cfg.num_items):
        if item not in skip:
            total += attn if item % 2 == 0 else mlp
    return total


def bound_s(nbytes: int, bandwidth: float = H200_BANDWIDTH) -> float:
    return nbytes / bandwidth


def memory_need(cfg: ModelConfig, batch: int, capacity: int, dtype_bytes: int,
                q: int = 16) -> int:
    """Device bytes a measurement needs: resident weights, the cache, logits and activations
    of a q-token forward (fp32 logits, a few hidden-size buffers per token), plus 5% slack."""
    acts = batch * q * (4 * cfg.vocab_size * 2 + 8 * max(cfg.hidden_size, cfg.intermediate_size)
                        * dtype_bytes)
    need = resident_bytes(cfg, dtype_bytes) + kv_bytes(cfg, batch * capacity, dtype_bytes) + acts
    return int(need * 1.05)


def spread(layers: range, fraction: float) -> list[int]:
    """``fraction`` of ``layers``, evenly spaced."""
    count = max(1, round(len(layers) * fraction))
    step = len(layers) / count
    return sorted({layers[int(i * step)] for i in range(count)})


def skip_sets(num_layers: int) -> dict[str, frozenset[int]]:
    """Draft skip sets of the check: attention of 25% / 50% of the layers, MLP of 25%, and a
    mix. Layer 0 and the last layer are always kept (skipping them hurts acceptance most)."""
    inner = range(1, max(2, num_layers - 1))
    a25, a50, m25 = spread(inner, 0.25), spread(inner, 0.5), spread(inner, 0.25)
    second = range(max(1, num_layers // 2), max(2, num_layers - 1))
    mixed = ({2 * layer for layer in spread(second, 0.5)}
             | {2 * layer + 1 for layer in spread(inner, 0.125)})
    return {"attn25": frozenset(2 * layer for layer in a25),
            "attn50": frozenset(2 * layer for layer in a50),
            "mlp25": frozenset(2 * layer + 1 for layer in m25), "mixed": frozenset(mixed)}
