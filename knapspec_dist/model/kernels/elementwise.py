"""The decoder's element-wise steps on a CPU, each in one pass (``kernels/elementwise.c``):
RMSNorm, the rotary embedding (in place) and ``silu(gate) * up``.

Why: torch runs each as several eager ops, every one a full pass over memory with a fresh
tensor (RMSNorm: pow, mean, rsqrt, two muls; rotary: a cat, a neg and three muls and an add
per tensor; the MLP: silu, then mul). In a 38k-token fp32 job on a 2-core AMD EPYC they were
about 7.5 % of the run, the largest share left beside the products and attention
(docs/measurements.md#against-vllms-cpu-build). Each op's result for an element (for the
norm, a row) depends on its own inputs only, never on the rows or threads beside it, so a
decode step and a verify of the same positions keep giving the same bits.

Applied from outside, as the packed products are (packed_linear.py): ``fuse_elementwise``
swaps each ``RMSNorm`` for a ``CPURMSNorm`` holding the same weight, and sets each
sublayer's ``rotary`` and ``gated`` functions, on a CPU where the kernels build (build.py:
AVX-512, AVX2, NEON or generic, one source) in fp32 or bf16. Elsewhere the decoder keeps
torch's ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from knapspec_dist.model.decoder import RMSNorm, apply_rotary, silu_and_mul
from knapspec_dist.model.decoder import rms_norm as torch_rms_norm
from knapspec_dist.model.kernels import build

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype codes
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels built for ``isa`` (default: the chosen build, model/kernels/build.py)."""
    return _typed(build.library("elementwise", isa))


@functools.cache
def _typed(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    if lib is not None:
        lib.rms_norm.argtypes = [_P, _I, _I, _I, _P, _F, _P, ctypes.c_int, ctypes.c_int]
        lib.rotary.argtypes = [_P] + [_I] * 7 + [_P, _P, _I, ctypes.c_int, ctypes.c_int]
        lib.silu_mul.argtypes = [_P, _I, _P, _I, _I, _I, _P, ctypes.c_int, ctypes.c_int]
        for fn in (lib.rms_norm, lib.rotary, lib.silu_mul):
            fn.restype = None
    return lib


def can_fuse(device: torch.device, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype in DTYPES and library() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, dim] with contiguous dims and one row stride (a view where one exists)."""
    try:
        flat = x.view(-1, x.shape[-1])
    except RuntimeError:
        flat = x.contiguous().view(-1, x.shape[-1])
    return flat if flat.stride(1) == 1 else flat.contiguous()


def recorded() -> bool:
    """Whether ops are being recorded (an emulated CUDA graph capture, engine/capture.py):
    there the kernels give way to torch's ops, which the capture records and a replay runs,
    as on CUDA, where the kernels never run."""
    return _get_current_dispatch_mode() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` over the last dim, the normalized row rounded
    to x's dtype before the weight (as the decoder's ``RMSNorm``)."""
    if recorded():
        return torch_rms_norm(x, weight, eps)
    flat = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype)
    library().rms_norm(flat.data_ptr(), flat.shape[0], flat.shape[1], flat.stride(0),
                       weight.contiguous().data_ptr(), eps, out.data_ptr(),
                       torch.get_num_threads(), DTYPES[x.dtype])
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's ``apply_rotary``, in place: q [B, T, H, hd] -> [B, H, T, hd] (a view),
    k [B, T, KV, hd] rotated where it is. Tables of one row serve every row (the DP's
    candidate states of one reference row)."""
    if recorded():
        return apply_rotary(q, k, meta)
    cos, sin = meta.cos.contiguous(), meta.sin.contiguous()
    for x in (q, k):
        b, t, h, hd = x.shape
        if x.stride(3) != 1 or cos.shape[0] not in (1, b) or cos.shape[2:] != (t, hd):
            raise ValueError(f"rotary of {tuple(x.shape)} (strides {x.stride()}) by tables "
                             f"{tuple(cos.shape)}")
        library().rotary(x.data_ptr(), b, t, h, hd, x.stride(0), x.stride(1), x.stride(2),
                         cos.data_ptr(), sin.data_ptr(), t * hd if cos.shape[0] > 1 else 0,
                         torch.get_num_threads(), DTYPES[x.dtype])
    return q.transpose(1, 2), k


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (silu rounded to the dtype first, as torch's two ops)."""
    if recorded():
        return silu_and_mul(gate, up)
    g, u = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype)
    library().silu_mul(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), g.shape[0],
                       g.shape[1], out.data_ptr(), torch.get_num_threads(), DTYPES[gate.dtype])
    return out


class CPURMSNorm(nn.Module):
    """The decoder's ``RMSNorm`` in one pass; its weight is the replaced norm's own."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def fuse_elementwise(model: nn.Module) -> int:
    """Route a CPU model's norms, rotary and gated activation through the kernels where
    ``can_fuse``; the count of sublayers (and the final norm) changed, 0 elsewhere."""
    if not can_fuse(model.device, model.dtype):
        return 0
    changed = 0
    for layer in model.layers:
        for block in (layer.attention, layer.mlp):
            for name, child in list(block.named_children()):
                if type(child) is RMSNorm:
                    setattr(block, name, CPURMSNorm(child))
            changed += 1
        layer.attention.rotary = rotary
        layer.mlp.gated = silu_mul
    model.norm = CPURMSNorm(model.norm)
    return changed + 1
