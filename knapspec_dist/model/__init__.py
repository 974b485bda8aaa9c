"""The model: config, decoder with skippable sublayers, per-forward step, attention backends,
KV cache, weights, tokenizer."""
