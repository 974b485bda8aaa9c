"""The decoder's steps on CUDA where a kernel there beats the portable one: the bf16 head.

cuBLAS reads the bf16 operands as they are and sums and writes in fp32
(``torch.mm(..., out_dtype=float32)``, which no CPU build has), so the head's fp32 logits
(model/head.py) cost no upcast copy of the head. Applied from outside at load, as the CPU's
kernels are (packed_linear.py, elementwise.py beside this module): ``use_cuda_kernels`` sets
the head's ``product``, the decoder's and the vocab-parallel one alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def cublas_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` of bf16 / fp16 operands, summed and returned in fp32 by cuBLAS."""
    flat = x.reshape(-1, x.shape[-1]).to(weight.dtype)
    return torch.mm(flat, weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)


def head_product(device: torch.device | str, dtype: torch.dtype) -> Callable | None:
    """The head's product on this device and dtype where CUDA's beats the portable one: a
    half-precision model on CUDA (an fp32 one's head is already the plain product)."""
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return cublas_logits
    return None


def use_cuda_kernels(model: nn.Module) -> bool:
    """Set the head's ``product`` to :func:`cublas_logits` where :func:`head_product` says;
    whether it did."""
    product = head_product(model.device, model.dtype)
    if product is None or not hasattr(model.lm_head, "product"):
        return False
    model.lm_head.product = product
    return True
