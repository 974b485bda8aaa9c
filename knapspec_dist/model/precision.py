"""What a run's greedy tokens promise against plain decoding (``ar``), by dtype and device.

A verify forward of q tokens and a 1-token decode step run different kernels, so their logits
differ in the last bits and an argmax can flip where two logits nearly tie. The rule is a
tolerance in ulps of the model's dtype at the top logit, per (dtype, device) in
``BOUND_ULPS`` (tools/ties.py proves each divergence against it, and says why): none for fp32
on a CPU and fp64 (token identity); for the others the gap a rounding divergence can have.

That gap is at most how unevenly the two paths' logit errors fall on the two tokens (the
spread, ``tools.ties.logit_spread``), and the bound is twice the largest spread measured:

- bf16 on a CPU: 7 ulps measured (SmolLM2, fp32 logits, 1-token decode and 2- and 5-token
  verify against a one-shot forward, 2 documents x 64 positions, top-5 tokens;
  ``scripts/logit_spread.py``, docs/bf16.md), hence 14. Over 16 documents, alone and in
  batches of 4-16 rows, 32.7 ulps, but only where the top logit is below 2 (ulps of 2^-7);
  kept at 14 because twice that, 66, would put 99 % of runner-ups within the bound
  (docs/bf16.md: the measurement and the decision);
- bf16 and fp16 on CUDA, fp16 on a CPU: not measured yet; the bf16 CPU value meanwhile;
- fp32 on CUDA: 27 ulps measured between fp32 CPU paths (tools/ties.py), hence 64.
"""

from __future__ import annotations

import torch

from knapspec_dist.model.weights import dtype_name, resolve_dtype

BOUND_ULPS: dict[tuple[str, str], int] = {
    ("bf16", "cpu"): 14,
    ("bf16", "cuda"): 14,
    ("fp16", "cpu"): 14,
    ("fp16", "cuda"): 14,
    ("fp32", "cuda"): 64,
}  # absent: 0, token identity
FP32_CUDA_ULPS = BOUND_ULPS[("fp32", "cuda")]
TOKEN_IDENTICAL = "token-identical"


def rule_ulps(dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """The near-tie tolerance in ulps of the top logit for a model of ``dtype`` on ``device``
    (0: exact identity)."""
    return BOUND_ULPS.get((dtype_name(dtype), torch.device(device).type), 0)


def guarantee(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> str:
    """The promise a run of ``dtype`` on ``device`` keeps, as reports state it:
    ``token-identical`` or ``identical up to near-ties (bf16 on cuda)``."""
    dtype = resolve_dtype(dtype) if isinstance(dtype, str) else dtype
    kind = torch.device(device).type
    if not rule_ulps(dtype, kind):
        return TOKEN_IDENTICAL
    return f"identical up to near-ties ({dtype_name(dtype)} on {kind})"
