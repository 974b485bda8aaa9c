"""Host numbers to the device without waiting: the one way the decode path uploads.

``torch.tensor(list, device="cuda")`` copies from pageable memory, which blocks the host until
the stream has caught up (a cudaStreamSynchronize per call). A pinned staging tensor copied
with ``non_blocking=True`` is queued like a kernel instead; torch's host allocator keeps the
staging memory until the copy has run. On a CPU the same code runs with pinning off (there is
nothing to pin, and the copy is the tensor itself).
"""

from __future__ import annotations

import torch


def upload(values, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` (nested lists of numbers) as a tensor on ``device``: one pinned,
    non-blocking copy."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
