"""CUDA graph capture semantics on a CPU, so that tests (and ``gpu-check --device cpu``) meet
the bugs that only a capture shows.

A CUDA graph's capture records kernels without running them: while capturing, no static
tensor changes (copies into buffers, cache writes and other in-place ops are only recorded),
and every tensor the capture allocates holds garbage until the first replay. ``EagerGraph``
instead runs the function during "capture", so code that reads a graph's outputs before
replaying it passes on a CPU and fails on a GPU. ``EmulatedGraph`` behaves like
``CudaGraph``: one eager warm-up, then a capture under a dispatch mode that records every op,
runs no mutation, and fills each fresh output with poison (NaN, the largest integer, True),
so that reading it before a replay gives NaN logits or an out-of-range index. A host read
during capture (``.item()``, ``bool(t)``, ``.tolist()``) raises, as it does on CUDA.
``replay()`` runs the recorded ops in order into the captured outputs.

The flex backend (the CUDA default) reaches the mode as torch's ``flex_attention``
higher-order operator: it is recorded as one kernel, its outputs shaped by torch's own shape
rule and poisoned, and the replay runs it eagerly on the buffers as they are then (the block
mask and the ``starts`` its mask reads included). Dynamo compiles no frame while a dispatch
mode is active, so the capture runs compiled functions eagerly (stance ``force_eager``) and the
compiled kernel and its guards run in the warm-up only; any other higher-order operator
raises, rather than being run during the capture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_fake_impl
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
               torch.ops.aten.is_nonzero.default}


class EagerGraph:
    """A graph stand-in: records the forward and re-runs it on replay (CPU tests). It runs the
    forward while "capturing", unlike CUDA: tests of capture order use ``EmulatedGraph``."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.output = fn()

    def replay(self) -> None:
        out = self.fn()
        _copy_into(self.output, out)


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    else:
        for d, s in zip(dst, src):
            _copy_into(d, s)


class CaptureError(RuntimeError):
    """Something CUDA does not allow inside a graph capture."""


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` with what an unwritten graph buffer may hold: NaN, the largest int, True."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


@dataclass
class _Op:
    func: object
    args: tuple
    kwargs: dict
    outputs: list  # the captured output tensors the replay fills; empty for mutations
    mutates: bool


def _storages(tree) -> set[int]:
    leaves, _ = tree_flatten(tree)
    return {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}


def _to_meta(x):
    """A tensor's shape and dtype on the meta device; a packed oneDNN weight (a CPU model's
    products, model/kernels/packed_linear.py) has no ``to("meta")``, so its logical shape
    stands in."""
    if isinstance(x, torch.Tensor) and x.is_mkldnn:
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x.to("meta") if isinstance(x, torch.Tensor) else x


# Higher-order operators the capture records, with the rule that shapes their outputs (as a
# meta kernel does for aten ops): none of them writes its inputs.
_HOP_SHAPES = {flex_attention: flex_attention_fake_impl}


class _Recorder(TorchDispatchMode):
    supports_higher_order_operators = True  # they reach __torch_dispatch__ (flex attention)

    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            if func not in _HOP_SHAPES:
                raise CaptureError(f"no capture emulation of the operator {func.name()}")
            out = _HOP_SHAPES[func](*args, **kwargs)  # fresh empty outputs, never run
            return self._fresh(func, args, kwargs, out)
        if func in _HOST_READS:
            raise CaptureError(f"{func} reads a device value back during graph capture")
        schema = func._schema
        writes = [i for i, a in enumerate(schema.arguments)
                  if a.alias_info is not None and a.alias_info.is_write]
        if writes:  # recorded, not run: the replay runs it
            self.ops.append(_Op(func, args, kwargs, [], True))
            names = [schema.arguments[i].name for i in writes]
            written = [kwargs[n] if n in kwargs else args[i] for i, n in zip(writes, names)]
            return written[0] if len(schema.returns) == 1 else tuple(written)
        if any(r.alias_info is not None for r in schema.returns):
            out = func(*args, **kwargs)  # a view (or a copy that may alias): no kernel reads data
            if _storages(out) <= _storages((args, kwargs)):
                return out
        else:  # shapes from the meta kernel: the real one would read the poison
            meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            device = next((t.device for t in tree_flatten((args, kwargs))[0]
                           if isinstance(t, torch.Tensor)), kwargs.get("device", "cpu"))
            out = tree_map(lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype,
                                                         device=device)
                           if isinstance(m, torch.Tensor) else m, meta)
        return self._fresh(func, args, kwargs, out)

    def _fresh(self, func, args, kwargs, out):
        """Record ``func`` as filling ``out`` on replay; until then ``out`` holds poison."""
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t in leaves:
            poison(t)
        self.ops.append(_Op(func, args, kwargs, leaves, False))
        return out


class EmulatedGraph:
    """A graph stand-in with CUDA's capture semantics (see the module docstring)."""

    def __init__(self, fn: Callable[[], object]):
        fn()  # warm-up, as CudaGraph's: it runs
        recorder = _Recorder()
        real_tolist = torch.Tensor.tolist

        def no_tolist(t):
            raise CaptureError("tolist() reads device values back during graph capture")

        torch.Tensor.tolist = no_tolist
        try:
            with torch.compiler.set_stance("force_eager"), recorder:
                self.output = fn()
        finally:
            torch.Tensor.tolist = real_tolist
        self.ops = recorder.ops

    def replay(self) -> None:
        for op in self.ops:
            out = op.func(*op.args, **op.kwargs)
            if not op.mutates:
                fresh = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                for dst, src in zip(op.outputs, fresh):
                    dst.copy_(src)
