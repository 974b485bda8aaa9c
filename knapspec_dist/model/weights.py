"""Load Hugging Face checkpoints (single-file or sharded safetensors) into the engine's model.

Weights are read tensor by tensor with ``safe_open``; ``read`` takes an optional slicer so a
tensor-parallel rank reads only its slice (``get_slice``), never the whole tensor.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from knapspec_dist.errors import UserError
from knapspec_dist.model.config import load_config
from knapspec_dist.model.decoder import Transformer, rope_frequencies
from knapspec_dist.model.kernels.cuda import use_cuda_kernels
from knapspec_dist.model.kernels.elementwise import fuse_elementwise
from knapspec_dist.model.kernels.packed_linear import pack_linears

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# ours -> Hugging Face parameter names
_RENAMES = [
    (r"^embed\.", "model.embed_tokens."),
    (r"^layers\.(\d+)\.attention\.norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.attention\.", r"model.layers.\1.self_attn."),
    (r"^layers\.(\d+)\.mlp\.norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^layers\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),
    (r"^norm\.", "model.norm."),
]

# A slicer gets (our name, safetensors slice, full shape) and returns the tensor to load.
Slicer = Callable[[str, object, tuple[int, ...]], torch.Tensor]


def hf_name(name: str) -> str:
    for pattern, repl in _RENAMES:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name


def dtype_name(dtype: torch.dtype) -> str:
    """Our short name of a torch dtype (fp32, bf16, fp16), as profiles and reports spell it."""
    names = {v: k for k, v in DTYPES.items()}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """``--device``: cpu, or cuda when a CUDA device is available (UserError otherwise)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise UserError(f"unknown device {name!r}; choose cpu or cuda")
    return torch.device(name)


def open_checkpoint(path: Path, stack: ExitStack | None = None):
    """``safe_open`` of one safetensors file; a corrupt or truncated file is a UserError that
    names it (safetensors' own SafetensorError would otherwise surface as a traceback)."""
    try:
        handle = safe_open(path, framework="pt")
        return stack.enter_context(handle) if stack is not None else handle
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({e})") from None


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UserError(f"{index}: malformed index ({e})") from None
        return {name: model_dir / f for name, f in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise UserError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    with open_checkpoint(single) as f:
        return {name: single for name in f.keys()}


def load_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", slicer: Slicer | None = None,
               prepare: Callable[[Transformer], None] | None = None) -> Transformer:
    """Build the model on the meta device, then read every parameter from the checkpoint.

    ``prepare`` reshapes the empty model before loading (tensor-parallel sharding does this).
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(f"model path {str(model_dir)!r} does not exist or is not a folder")
    cfg = load_config(model_dir)
    files = checkpoint_files(model_dir)
    with torch.device("meta"):
        model = Transformer(cfg)
    if prepare is not None:
        prepare(model)
    state = {}
    with ExitStack() as stack:
        handles = {}
        for name, param in model.state_dict().items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            source = hf_name(name)
            if source not in files:
                raise UserError(f"{model_dir}: checkpoint lacks tensor {source!r}")
            path = files[source]
            if path not in handles:
                handles[path] = open_checkpoint(path, stack)
            try:
                sl = handles[path].get_slice(source)
                full = tuple(sl.get_shape())
                tensor = slicer(name, sl, full) if slicer else sl[:]
            except SafetensorError as e:
                raise UserError(f"{path}: cannot read tensor {source!r} ({e})") from None
            if tuple(tensor.shape) != tuple(param.shape):
                raise UserError(f"{model_dir}: tensor {source!r} has shape {tuple(tensor.shape)}, "
                                f"expected {tuple(param.shape)}")
            state[name] = tensor.to(device=device, dtype=dtype)
    missing, _ = model.load_state_dict(state, assign=True, strict=False)
    del state  # the model holds each tensor now: packing frees each dense weight as it goes
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    assert not missing, f"parameters not loaded: {missing}"
    model.inv_freq = rope_frequencies(cfg)[0].to(device)
    model.eval()
    # The device kernels, applied from outside (model/kernels/): on a CPU the products
    # through oneDNN and the element-wise steps in one pass each; on CUDA the bf16 head's
    # fp32 sums by cuBLAS.
    pack_linears(model)
    fuse_elementwise(model)
    use_cuda_kernels(model)
    return model




def random_llama_weights(*, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
                         kv_heads: int, head_dim: int, tied: bool = True, seed: int = 0,
                         std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random tensors under Hugging Face Llama names, for checkpoints of a chosen shape (the
    TP benchmark's TP-divisible SmolLM2 shape, the tests' large model); norms are ones."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * std

    t = {"model.embed_tokens.weight": rnd(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    if not tied:
        t["lm_head.weight"] = rnd(vocab, hidden)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = torch.ones(hidden)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        t[p + "self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = rnd(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = rnd(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = rnd(hidden, intermediate)
    return t
