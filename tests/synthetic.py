"""Latency profiles built from made-up samples, for tests (never written under profiles/).
Imports no Ray: the GPU image's tests use them too."""

from __future__ import annotations

import torch

from knapspec_dist.profiles import fit_profile


def synthetic_profile(model, attention: list[tuple[int, float]], mlp: float = 7e-4,
                      verify_growth: float = 0.1, verify_scale: float = 1.0):
    """A profile built from made-up samples (tests only; never written under profiles/)."""
    layers = model.cfg.num_layers
    ns = [n for n, _ in attention]

    def step(n):  # one full-model decode step at context n, from the same fit
        slope = (attention[-1][1] - attention[0][1]) / (ns[-1] - ns[0])
        return layers * (attention[0][1] + slope * (n - ns[0]) + mlp) + 1e-3

    samples = {"attention": [[n, t] for n, t in attention], "mlp": [mlp] * 3, "head": [1e-3] * 3,
               "verify": [[q, n, verify_scale * step(n) * (1 + verify_growth * (q - 1))]
                          for q in range(1, 12) for n in ns]}
    return fit_profile(samples, device={"name": "synthetic", "threads": 1},
                       model=model.cfg.shape(), dtype="fp32", batch=1, tp=1,
                       torch_version=torch.__version__)


LINEAR_ATTENTION = [(64, 5e-4), (4096, 4e-3)]


def drafting_profile(shape: dict | None = None):
    """A fixed in-memory latency profile (test fixture; never written to profiles/): drafts
    nearly free next to a slow verify, so the TPT search drafts even at the low acceptance of
    a random model, and the draft/verify path runs with KnapSpec's plans under TP. ``shape``:
    the model shape it records (for a file a model's options may name)."""
    samples = {"attention": [[n, 1e-9 * n + 1e-6] for n in (16, 64, 256)],
               "mlp": [1e-6], "head": [1e-6],
               "verify": [[q, n, 1.0 + 1e-3 * q] for q in (1, 4, 11) for n in (16, 64, 256)]}
    return fit_profile(samples, device={"name": "test"}, model=shape or {}, dtype="fp32",
                       batch=1, tp=1,
                       torch_version=torch.__version__)
