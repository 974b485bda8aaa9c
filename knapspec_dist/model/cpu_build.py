"""Our C kernels for CPUs (``model/kernels/*.c``): built once per source and compiler flags,
loaded through ctypes.

Why built here and not shipped compiled: the kernels use AVX-512 intrinsics and OpenMP, and a
build on the machine that runs them takes about a second with the system's ``cc`` (else
``gcc``). The library goes to ``$KNAPSPEC_CACHE/kernels``, named by a hash of the source, the
shared headers and the flags; it is built beside the target and renamed, so ranks starting
together never load half a file. OpenMP is torch's own (the same ``libgomp.so.1``, already
loaded), so the kernels and torch's ops share one thread pool. ``-ffp-contract=off``: a
product and a sum written apart round apart, as torch's eager ops do (the kernels write a
fused multiply-add where they mean one).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from knapspec_dist.model.embedded import cache_dir

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
FLAGS = ("-O3", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma", "-fopenmp",
         "-ffp-contract=off", "-fPIC", "-shared")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def unavailable_reason() -> str | None:
    """Why this machine cannot run our kernels, or None when it can."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
        return f"the CPU lacks AVX-512 ({torch.backends.cpu.get_cpu_capability()})"
    if _compiler() is None:
        return "no C compiler (cc or gcc) on PATH"
    return None


@functools.cache
def library(name: str) -> ctypes.CDLL | None:
    """``kernels/<name>.c`` as a loaded library, built on first use; None (logged once) where
    it cannot be built or loaded."""
    reason = unavailable_reason()
    if reason is None:
        try:
            return _load(KERNELS / f"{name}.c", _compiler())
        except (OSError, subprocess.CalledProcessError) as e:
            reason = f"building {name}.c failed: {e}"
    log.info("CPU kernels: torch's ops (our %s kernel is unavailable: %s)", name, reason)
    return None


def _load(source: Path, cc: str) -> ctypes.CDLL:
    headers = b"".join(h.read_bytes() for h in sorted(KERNELS.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers
                         + " ".join((cc,) + FLAGS).encode()).hexdigest()
    folder = cache_dir() / "kernels"
    target = folder / f"{source.stem}-{key[:16]}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            subprocess.run([cc, *FLAGS, "-o", tmp, str(source), "-lm"], check=True,
                           capture_output=True, text=True)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))
