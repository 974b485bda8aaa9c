"""Speculation: the KnapSpec knapsack DP, the Tokens-per-Time search, and the draft/verify loop."""
