"""KnapSpec self-speculative decoding on tensor-parallel Llama / Qwen3 shards, for batch jobs."""

__version__ = "0.1.0"
