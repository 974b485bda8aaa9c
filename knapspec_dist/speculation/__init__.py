"""Speculation: autoregressive and self-speculative strategies, the KnapSpec knapsack DP, the
Tokens-per-Time search, their options, and SPMD execution under tensor parallelism."""
