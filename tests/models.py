"""Small random-weight Hugging Face checkpoints for tests (written with transformers itself)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

# Larger-than-default init keeps logits well separated, so greedy ties (which fp32 rounding
# could break differently in two correct implementations) do not occur.
INIT = 0.25

CONFIGS = {
    "llama-gqa": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "llama-tied-llama3rope": dict(
        arch="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256}),
    "qwen3-headdim": dict(arch="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                          tie_word_embeddings=True),
    "llama-sharded": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                          shard=True),
}


def make_checkpoint(name: str, root: Path, vocab_size: int = 256, seed: int = 0) -> Path:
    """Write a random checkpoint (config.json + safetensors) and return its folder."""
    spec = dict(CONFIGS[name])
    arch, shard = spec.pop("arch"), spec.pop("shard", False)
    cls, model_cls = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if arch == "llama"
                      else (transformers.Qwen3Config, transformers.Qwen3ForCausalLM))
    spec.setdefault("max_position_embeddings", 2048)
    cfg = cls(vocab_size=vocab_size, initializer_range=INIT, bos_token_id=None, eos_token_id=1,
              pad_token_id=None, **spec)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    path = root / name
    model.save_pretrained(path, max_shard_size="100KB" if shard else "10GB")
    return path


def hf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
