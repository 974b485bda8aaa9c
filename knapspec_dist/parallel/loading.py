"""Sliced loading: each TP rank reads only its part of every sharded tensor."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open

from knapspec_dist.errors import UserError
from knapspec_dist.model.config import ModelConfig, load_config
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.model.kernels.packed_linear import PackedGroup, PackedHead, PackedLinear
from knapspec_dist.model.weights import checkpoint_files, hf_name, load_model
from knapspec_dist.parallel.comm import Comm
from knapspec_dist.parallel.layers import Layout, layout, shard_modules

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split output features (rows)
_ROW = ("o_proj", "down_proj")  # split input features (columns)


def make_slicer(cfg: ModelConfig, lay: Layout, files: dict[str, Path]):
    """``slicer(name, safetensors_slice, full_shape)`` -> only this rank's part of the tensor.

    safetensors returns slices as views of its memory map, and a page fault maps neighbouring
    file pages too (fault-around), so with ``load_model``'s handles open for the whole load a
    rank's RSS would grow by far more than its slices (every page of a column slice whose rows
    are shorter than a few pages). Each sharded tensor is therefore read through its own short
    ``safe_open`` handle, copied into this rank's memory, and the map closed: after loading a
    rank holds exactly its slices, and its peak is that plus one tensor's touched pages.
    """
    hd = cfg.head_dim
    rows_per = {"q_proj": lay.heads * hd, "k_proj": lay.kv_heads * hd,
                "v_proj": lay.kv_heads * hd, "gate_proj": lay.intermediate,
                "up_proj": lay.intermediate}
    cols_per = {"o_proj": lay.heads * hd, "down_proj": lay.intermediate}

    def read(name: str, index) -> torch.Tensor:
        source = hf_name(name)
        with safe_open(files[source], framework="pt") as f:
            view = f.get_slice(source)[index]
            out = torch.empty(view.shape, dtype=view.dtype)
            out.copy_(view)
            del view
        return out

    def slicer(name: str, sl, full: tuple[int, ...]) -> torch.Tensor:
        parts = name.split(".")
        if lay.world == 1:
            return sl[:]
        if parts[0] in ("embed", "lm_head"):
            piece = read(name, slice(lay.vocab_start, lay.vocab_end))
            pad = lay.vocab_chunk - piece.shape[0]
            return F.pad(piece, (0, 0, 0, pad)) if pad else piece
        module = parts[-2] if len(parts) >= 2 else ""
        if module in _COLUMN:
            n = rows_per[module]
            return read(name, slice(lay.rank * n, (lay.rank + 1) * n))
        if module in _ROW:
            n = cols_per[module]
            if parts[-1] == "bias":  # added once: rank 0 holds it, the all-reduce sums it in
                bias = read(name, slice(None))
                return bias if lay.rank == 0 else torch.zeros_like(bias)
            return read(name, (slice(None), slice(lay.rank * n, (lay.rank + 1) * n)))
        return read(name, slice(None))  # norms: replicated (small)

    return slicer


def load_sharded(model_dir: str | Path, rank: int, world: int, *, group=None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 timed: bool = True) -> Transformer:
    """Load this rank's shard of a checkpoint (world == 1: the whole model, ``model.tp`` set).

    The process group must already be initialized when world > 1.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(f"model path {str(model_dir)!r} does not exist or is not a folder")
    cfg = load_config(model_dir)
    lay = layout(cfg, rank, world)
    comm = Comm(group if group is not None else (dist.group.WORLD if world > 1 else None),
                rank, world, timed=timed, cuda=torch.device(device).type == "cuda")
    files = checkpoint_files(model_dir) if world > 1 else {}
    model = load_model(model_dir, dtype=dtype, device=device, slicer=make_slicer(cfg, lay, files),
                       prepare=lambda m: shard_modules(m, lay, comm))
    return model


def parameter_bytes(model: Transformer) -> int:
    """Bytes of this rank's parameters (a tied weight counted once), a CPU model's packed
    weights (model/kernels/packed_linear.py) included."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for m in model.modules():
        if isinstance(m, (PackedLinear, PackedGroup, PackedHead)):
            total += m.packed.numel() * m.packed.element_size()
    return total
