"""``knapspec peer``: the same Parquet job through this engine and through vLLM."""
