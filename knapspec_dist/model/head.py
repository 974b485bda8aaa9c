"""The vocabulary head: fp32 logits summed in fp32 whatever the model's dtype.

The decoder's head (``LMHead``) and the vocab-parallel one (parallel/layers.py) both call
their ``product``, :func:`head_logits` unless a device's module chose its own at load: an
fp32 CPU model's head is swapped for oneDNN's (model/kernels/packed_linear.py), a bf16 CUDA model's
product is cuBLAS' (model/kernels/cuda.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HEAD_ROWS = 1024  # vocabulary rows upcast at a time (a 2.4 MB fp32 block at 576)


def head_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with fp32 output, whatever the model's dtype, on any device.

    A bf16 output would round every logit to 8 significant bits: at logits in [16, 32) that
    is a 0.125 grid, so two tokens whose true logits differ by less than that tie exactly
    (2.1 % of SmolLM2's greedy positions in bf16), and the near-tie bound can no longer tell a
    wrong token from rounding. Here the products are summed in fp32 and kept in fp32 by
    upcasting ``HEAD_ROWS`` rows of the head at a time (exact: bf16 values are fp32 values),
    so the fp32 copy never exists whole (a 128k x 8k head is 4 GB in fp32) and the block stays
    in cache. Measured on SmolLM2 in bf16 (2-core CPU): the head costs about what the bf16 one
    did at one token and ~1.4x at 5-11 tokens (docs/measurements.md). An fp32 model is
    unchanged: its head is the plain fp32 linear.
    """
    if weight.dtype == torch.float32:
        return F.linear(x, weight)
    x = x.float()
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    for start in range(0, weight.shape[0], HEAD_ROWS):
        rows = weight[start:start + HEAD_ROWS]
        out[..., start:start + rows.shape[0]] = F.linear(x, rows.float())
    return out


class LMHead(nn.Linear):
    """The vocabulary projection, with fp32 logits (``product``: :func:`head_logits`)."""

    product = staticmethod(head_logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight)
