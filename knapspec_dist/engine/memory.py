"""How many rows a replica decodes at once by default: as many as the memory left after the
weights holds, within a cap.

The rule (``default_max_num_seqs``): each row needs a KV cache of ``capacity`` positions,
``kv_bytes_per_token`` each (2 x layers x local KV heads x head_dim x dtype bytes). Rows =
floor(0.9 x free bytes / bytes per row), where free is what the device reports free once the
weights are loaded (CUDA: ``torch.cuda.mem_get_info``; CPU: half the available RAM, the rest
being the process's working memory and the page cache), at least 1 and at most the cap: 256 on
a GPU (vLLM's default), 16 on a CPU, where a step is compute-bound and larger batches add
latency without throughput.

A ``max_num_seqs`` the user gives is not capped at 16 or 256 (those are speed choices), but
it must fit: ``rows_that_fit`` is the rule without the cap. The engine refuses a number
that cannot fit even on an empty node before it starts a replica (runtime/setup.py's
``check_batch_memory``, from the model config: ``kv_bytes_per_token_of``), and each shard
caps what it was asked at what its free memory holds once its weights are loaded.
"""

from __future__ import annotations

import psutil
import torch

from knapspec_dist.errors import UserError

GPU_CAP, CPU_CAP = 256, 16
HEADROOM = 0.9  # activations, logits and the allocator's slack


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V for one position of one row, over all layers (local heads under TP)."""
    attn = model.layers[0].attention
    elem = torch.empty((), dtype=model.dtype).element_size()
    return 2 * model.cfg.num_layers * attn.num_kv_heads * attn.head_dim * elem


def kv_bytes_per_token_of(config, tp: int, dtype: torch.dtype) -> int:
    """``kv_bytes_per_token`` from a ModelConfig, before any weights are loaded (KV heads
    split ``tp`` ways, at least one per rank)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * max(1, config.num_kv_heads // tp) * config.head_dim * elem


def rows_that_fit(free: int, per_token: int, capacity: int) -> int:
    """Rows whose caches of ``capacity`` positions fit in ``HEADROOM`` of ``free`` bytes
    (no cap; 0 when not even one does)."""
    return max(0, int(HEADROOM * free) // max(1, per_token * capacity))


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available // 2)


def default_max_num_seqs(free: int, per_token: int, capacity: int, cap: int) -> int:
    """Rows whose caches of ``capacity`` positions fit in ``HEADROOM`` of ``free`` bytes."""
    return max(1, min(cap, rows_that_fit(free, per_token, capacity)))


def max_num_seqs_for(model, capacity: int) -> int:
    """``default_max_num_seqs`` for a loaded model on its device."""
    cap = GPU_CAP if model.device.type == "cuda" else CPU_CAP
    return default_max_num_seqs(free_bytes(model.device), kv_bytes_per_token(model), capacity, cap)


def fitting_max_num_seqs(model, capacity: int) -> int:
    """The most rows a loaded model's free memory holds (the rule without the cap; >= 1)."""
    return max(1, rows_that_fit(free_bytes(model.device), kv_bytes_per_token(model), capacity))


_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_size(text: str) -> int:
    """Bytes of a size a user wrote: ``2GiB``, ``1.5GB``, ``300000000``."""
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise UserError(f"expected a size such as 2GiB or 500MB, got {text!r}")
    return int(value * _UNITS[unit])
