"""Our own CPU attention kernel over the paged KV cache (``csrc/paged_attention.c``).

Why: torch's SDPA cannot read a paged cache, so the CPU path attended row by row, one call
per row per layer, each reading a row's keys at a third of the memory's rate (decode
attention was 70 % of a decode step at 16 rows of 3-5k keys), and a fresh prefill's causal
flash kernel ran at about 60 % of the cores' FMA rate (docs/measurements.md). This kernel
does a whole forward of one layer in one call: every row, every head, any number of new
tokens per row (prefill, chunked prefill, decode, verify), over the rows' pages, no mask and
no gather.

- **Layout.** A page holds 16 positions. Keys are stored per page dims-major, ``[KV, pages,
  head_dim, 16]``: a page's keys are 16 floats per dim (one AVX-512 vector, two AVX2 ones),
  so ``q . K`` is a broadcast-FMA per dim and no key is transposed at read time. Values stay
  position-major, ``[KV, pages * 16, head_dim]``. The cache writes keys in this layout when
  built with ``key_layout="dims"`` (model/paged_cache.py).
- **Work.** Each KV head's query group is folded into rows (position-major, then head), so a
  key is read once per KV head, not once per query head. A unit of work is a tile of up to 8
  folded rows (4 where the vector unit has fewer registers) of one batch row and one KV
  head, done by one thread over all its pages with an online softmax (flash attention);
  units are shared out dynamically by OpenMP, through torch's own OpenMP runtime (the same
  ``libgomp.so.1``, already loaded), so the kernel and torch's ops use one thread pool.
- **Bits.** A query row's result depends on its own query, keys and position only: pages
  are visited in order from the first, a page wholly past a row's position is skipped for
  that row, and every row's arithmetic is the same whether its tile has 1 row or 8. So a
  decode step and a verify of the same positions give the same bits (the lossless check of
  speculation rests on it), whatever the batch, the thread count or the build.
- **Where.** Any CPU with a C compiler that build.py builds for (AVX-512 or AVX2 on x86, NEON
  on Arm, generic elsewhere; one source, csrc/vec.h); fp32 and bf16 models (bf16 queries,
  keys and values are widened exactly to fp32, the arithmetic is fp32, the output rounded
  to nearest even). Elsewhere the attention backend stays ``sdpa``,
  which reads the same cache laid out position-major.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from knapspec_dist.model.kernels import build

PAGE = 16  # positions per page: csrc/vec.h's logical width W
MAX_HEAD_DIM = 256


def library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernel built for ``isa`` (default: the chosen build, model/kernels/build.py), its
    entry typed; None where it cannot run."""
    return _typed(build.library("paged_attention", isa))


@functools.cache
def _typed(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    if lib is not None:
        lib.paged_attention.restype = ctypes.c_int
        lib.paged_attention.argtypes = (
            [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
            + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_int] * 5 + [ctypes.c_float]
            + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int])
    return lib


DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's dtype codes


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a model of this dtype and head size runs on the kernel here."""
    return (dtype in DTYPES and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
            and library() is not None)


def check_indices(table: torch.Tensor, starts: torch.Tensor, tokens: int, pages: int) -> None:
    """The kernel trusts its indices: a page or position out of range would read past the
    pool. Checked once per forward (model/forward_meta.py), not once per layer."""
    if table.numel() and starts.numel() and (
            int(starts.max()) + tokens > table.shape[1] * PAGE or int(starts.min()) < 0
            or int(table.max()) >= pages or int(table.min()) < 0):
        raise ValueError(f"positions up to {int(starts.max()) + tokens} or pages outside the "
                         f"table's {table.shape[1]} blocks / the pool's {pages} pages")


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    table: torch.Tensor, starts: torch.Tensor,
                    checked: bool = False) -> torch.Tensor:
    """q [B, H, T, hd] (any strides with contiguous dims) at positions ``starts[b] ..
    starts[b]+T-1`` against the pools ``keys`` [KV, pages, hd, 16] and ``values`` [KV,
    pages*16, hd] through ``table`` [B, blocks] -> [B, T, H*hd]: row b's query i sees its keys
    ``0 .. starts[b]+i``. ``checked``: ``check_indices`` already passed for this forward."""
    b, h, t, hd = q.shape
    kv, pages = keys.shape[0], keys.shape[1]
    if keys.dim() != 4 or keys.shape[3] != PAGE:
        raise ValueError(f"keys must be laid out [KV, pages, hd, {PAGE}], got "
                         f"{tuple(keys.shape)}")
    if not q.dtype == keys.dtype == values.dtype or q.dtype not in DTYPES:
        raise ValueError(f"paged attention runs fp32 or bf16 (q, keys and values alike), got "
                         f"{q.dtype}, {keys.dtype}, {values.dtype}")
    if q.stride(3) != 1:
        q = q.contiguous()
    table = table.contiguous()
    starts = starts.to(torch.int64).contiguous()
    if not checked:
        check_indices(table, starts, t, pages)
    out = q.new_empty(b, t, h * hd)
    rc = library().paged_attention(
        q.data_ptr(), q.stride(0), q.stride(2), q.stride(1), keys.data_ptr(),
        values.data_ptr(), table.data_ptr(), table.shape[1], starts.data_ptr(), pages, b, t, h,
        kv, hd, hd ** -0.5, out.data_ptr(), torch.get_num_threads(), DTYPES[q.dtype])
    if rc != 0:
        raise ValueError(f"paged attention cannot run heads {h}/{kv} of size {hd}")
    return out
