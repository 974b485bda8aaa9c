"""What a run's greedy tokens promise against plain decoding (``ar``), by dtype and device.

A verify forward of q tokens and a 1-token decode step run different kernels, so their logits
differ in the last bits and an argmax can flip where two logits nearly tie. The rule, in ulps
of the dtype at the top logit (justified in tools/ties.py, which proves each divergence
against it): 0 for fp32 on a CPU and fp64 (token identity), ``FP32_CUDA_ULPS`` for fp32 on
CUDA (cuBLAS picks GEMV or GEMM, split-K or not, by shape), ``ULPS`` for bf16 and fp16
anywhere (also across batch sizes, whose kernels differ too).
"""

from __future__ import annotations

import torch

from knapspec_dist.model.weights import dtype_name, resolve_dtype

ULPS = 4  # bf16 / fp16 tolerance in units of the dtype's spacing at the top logit
FP32_CUDA_ULPS = 64  # fp32 on CUDA: its decode and verify run different cuBLAS kernels
TOKEN_IDENTICAL = "token-identical"


def rule_ulps(dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """The near-tie tolerance in ulps of the top logit for a model of ``dtype`` on ``device``
    (0: exact identity)."""
    if dtype == torch.float32 and torch.device(device).type == "cuda":
        return FP32_CUDA_ULPS
    if dtype in (torch.float32, torch.float64):
        return 0
    return ULPS


def guarantee(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> str:
    """The promise a run of ``dtype`` on ``device`` keeps, as reports state it:
    ``token-identical`` or ``identical up to near-ties (bf16 on cuda)``."""
    dtype = resolve_dtype(dtype) if isinstance(dtype, str) else dtype
    kind = torch.device(device).type
    if not rule_ulps(dtype, kind):
        return TOKEN_IDENTICAL
    return f"identical up to near-ties ({dtype_name(dtype)} on {kind})"
