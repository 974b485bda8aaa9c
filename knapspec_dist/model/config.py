"""Model shape read from a Hugging Face config.json, for the architectures this engine runs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import transformers

from knapspec_dist.errors import UserError

SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope: dict  # transformers' rope_parameters (rope_type, rope_theta, scaling fields)
    eos_token_ids: tuple[int, ...]

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def num_items(self) -> int:
        """Knapsack items: Attention and MLP of every layer.

        Item 2l is the attention of layer l, item 2l+1 its MLP.
        """
        return 2 * self.num_layers

    def shape(self) -> dict:
        return {"arch": self.arch, "layers": self.num_layers, "hidden": self.hidden_size,
                "heads": self.num_heads, "kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "intermediate": self.intermediate_size, "vocab": self.vocab_size}

    def hf_config(self):
        """The transformers config object, for its rope utilities."""
        cls = transformers.LlamaConfig if self.arch == "llama" else transformers.Qwen3Config
        return cls(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                   intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                   num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                   head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
                   rope_parameters=dict(self.rope), rms_norm_eps=self.rms_norm_eps)


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{model_dir}: no config.json (not a Hugging Face model folder)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: malformed config.json ({e})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: malformed config.json (not a JSON object)")
    return config_from_dict(raw, source=str(path))


def config_from_dict(raw: dict, source: str = "config") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
    if arch is None:
        arch = {"llama": "llama", "qwen3": "qwen3"}.get(raw.get("model_type", ""))
    if arch is None:
        raise UserError(f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                        f"supported: {', '.join(SUPPORTED)}")
    if raw.get("use_sliding_window"):
        raise UserError(f"{source}: sliding-window attention is not supported")
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope.setdefault("rope_theta", float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            arch=arch, vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)), rope=rope, eos_token_ids=eos_ids)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{source}: malformed config ({type(e).__name__}: {e})") from None
