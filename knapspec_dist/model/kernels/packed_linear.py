"""The decoder's matrix products on a CPU: oneDNN with each weight packed once, at load.

Why: torch's CPU ``linear`` (MKL's sgemm, the weight re-read in its row-major layout on every
call) is slow exactly where decoding lives, a few rows against a large weight, and its rows'
results depend on how many rows the call has below 12, so a decode step and a verify of the
same positions could round apart. oneDNN over a weight reordered once into its blocked layout
(what inductor's CPU freezing does), measured on a 2-core AMD EPYC over SmolLM2's 90 MLP-shaped
weights (docs/measurements.md#against-vllms-cpu-build): 2.2x faster at 12 rows, 1.8x at 1,
1.2x at a 2048-row prefill chunk; in bf16 2.0x at 12 rows, 1.1x at 2048. On that CPU a row's
result was the same bits whatever the other rows (checked from 1 to 2048 rows, a
measurement, not a test: it is the kernel's property on one CPU), which the token-for-token
identity of speculation with plain decoding rests on; the identity itself is tested.

Applied from outside, as tensor parallelism is (parallel/layers.py): ``pack_linears`` swaps
each sublayer's ``nn.Linear`` for a ``PackedLinear`` after the weights are loaded (and
sharded); the packed copy is the one kept. The products of one input (q, k and v; gate and
up) become one ``PackedGroup``, the sublayer's ``merged``: one weight read and one call
where there were three or two (at 12 decoding rows, 2-core AMD EPYC: q, k, v 131 -> 86 us,
gate and up 241 -> 216 us a layer). The vocabulary head is packed in fp32,
where its logits are the plain product (not timed on its own); in bf16 it keeps its fp32
accumulation (head.py ``head_logits``), and under tensor parallelism its vocab-parallel
module.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
from torch import nn

from knapspec_dist.model.head import LMHead

log = logging.getLogger(__name__)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN runs this model's products: a CPU with oneDNN, in fp32, or in bf16 where
    oneDNN's bf16 path exists on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT on x86: on an
    AVX2-only CPU its weight reorder raises). Elsewhere the model keeps torch's ``linear``."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16())


def onednn_bf16() -> bool:
    """Whether oneDNN computes bf16 products on this CPU."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """``nn.Linear``'s product through oneDNN over its weight packed once. The packed copy is
    the only one kept (a model's weights are not held twice); ``weight`` gives a dense copy to
    a reader."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = _pack(linear.weight)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PackedHead(nn.Module):
    """The fp32 vocabulary head through oneDNN. Its weight stays the model's (tied to the
    embedding, or read and edited in place, as the near-tie tests do): the packed copy is made
    again when the weight has changed since (its version counter)."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.weight = head.weight
        self.in_features, self.out_features = head.in_features, head.out_features
        self.packed, self._version = _pack(head.weight), head.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight._version != self._version:
            self.packed, self._version = _pack(self.weight), self.weight._version
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class PackedGroup(nn.Module):
    """Products of one input by several weights (``weight``: theirs stacked, ``sizes``: each
    one's rows), as one product over the stack packed once; its output split into each
    weight's part (views)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        super().__init__()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.sizes = sizes
        self.packed = _pack(weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out.split(self.sizes, dim=-1)


GROUPS = {"attention": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def _pack(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def pack_linears(model: nn.Module) -> int:
    """Merge each sublayer's products of one input into a ``PackedGroup`` and swap its other
    ``nn.Linear`` for a ``PackedLinear`` (and an fp32 ``LMHead`` for a ``PackedHead``) where
    ``can_pack``; the count of linears swapped (0 elsewhere: the model is left as it was)."""
    if not can_pack(model.device, model.dtype):
        if torch.device(model.device).type == "cpu" and model.dtype == torch.bfloat16:
            _log_unpacked_bf16()
        return 0
    swapped = 0
    for layer in model.layers:
        for kind, block in (("attention", layer.attention), ("mlp", layer.mlp)):
            group = [getattr(block, name) for name in GROUPS[kind]]
            if all(type(linear) is nn.Linear for linear in group):
                weight = torch.cat([linear.weight.detach() for linear in group])
                bias = (None if group[0].bias is None
                        else torch.cat([linear.bias.detach() for linear in group]))
                sizes = [linear.out_features for linear in group]
                for name in GROUPS[kind]:  # freed before packing: one dense copy at a time
                    delattr(block, name)
                del group
                block.merged = PackedGroup(weight, bias, sizes)
                del weight
                _return_freed_memory()
                swapped += len(sizes)
            for name, child in list(block.named_children()):
                if type(child) is nn.Linear:
                    setattr(block, name, PackedLinear(child))
                    swapped += 1
    if type(model.lm_head) is LMHead and model.dtype == torch.float32:
        model.lm_head = PackedHead(model.lm_head)
        swapped += 1
    _return_freed_memory()
    return swapped


@functools.cache
def _log_unpacked_bf16() -> None:
    log.info("bf16 products through torch's linear: oneDNN has no bf16 path on this CPU")


def _return_freed_memory() -> None:
    """Hand the heap's freed dense copies back to the system (glibc keeps them otherwise:
    a rank would hold its weights' share plus the last copies' worth)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None
