"""The model: config, decoder with skippable sublayers, per-forward metadata, attention backends,
KV cache, weights, tokenizer."""
