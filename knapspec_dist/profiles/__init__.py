"""Latency profiles: fitted per-sublayer costs that set the knapsack weights and the TPT model."""

from knapspec_dist.profiles.profile import (
    LatencyProfile,
    LinearFit,
    fit_linear,
    fit_profile,
    integer_weights,
)

__all__ = ["LatencyProfile", "LinearFit", "fit_linear", "fit_profile", "integer_weights"]
