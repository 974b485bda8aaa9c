"""Our C kernels for CPUs (``csrc/*.c``): built for the machine's own vector unit, once per
source, instruction set and compiler, and loaded through ctypes.

Why built here and not shipped compiled: a build on the machine that runs it takes about a
second with the system's ``cc`` (else ``gcc``) and targets exactly its instruction set. Each
kernel is written once against ``csrc/vec.h``'s vector type, and built for one of ``ISAS``:
AVX-512 or AVX2 on x86, NEON on Arm, and ``generic`` (the compiler's own lowering of the
vector type, for any other CPU a compiler targets). Every build computes the same bits
(vec.h says how), so a cluster of mixed CPUs decodes alike.

The setting ``KNAPSPEC_CPU_KERNELS`` chooses: ``auto`` (the default: the best build this CPU
executes; torch's ops on an x86 CPU without AVX2), an instruction set by name (a lower one
than the machine's, to test or compare it; one the CPU cannot execute is refused), or
``off`` (torch's ops). The library goes to ``$KNAPSPEC_CACHE/kernels``, named by the source,
the instruction set and a hash of the source, the headers, the flags, the compiler's version
and the machine's architecture, so a cache on storage shared by nodes of several CPUs never
loads another node's build; it is built beside the target and renamed, so ranks starting
together never load half a file. OpenMP is torch's own (the same ``libgomp.so.1``, already
loaded), so the kernels and torch's ops share one thread pool. ``-ffp-contract=off``: a
product and a sum written apart round apart (the kernels write a fused multiply-add where
they mean one).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from knapspec_dist.cache import cache_dir
from knapspec_dist.errors import UserError

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")
SETTING = "KNAPSPEC_CPU_KERNELS"
#: Each build's flags, best first; ``generic`` has none beyond the macro vec.h reads.
ISAS = {
    "avx512": ("-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma",
               "-DKNAPSPEC_AVX512"),
    "avx2": ("-mavx2", "-mfma", "-DKNAPSPEC_AVX2"),
    "neon": ("-DKNAPSPEC_NEON",),
    "generic": ("-DKNAPSPEC_GENERIC",),
}
COMMON_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")
_X86_FEATURES = {"avx512": {"avx512f", "avx512dq", "avx512bw", "avx512vl", "fma"},
                 "avx2": {"avx2", "fma"}}


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo); else what torch's dispatch found."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AVX512_BF16", "AMX"):
        return frozenset(_X86_FEATURES["avx512"])
    return frozenset(_X86_FEATURES["avx2"]) if capability == "AVX2" else frozenset()


def executable_isas() -> list[str]:
    """The builds this CPU executes, best first (``generic`` on every CPU)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        flags = _cpu_flags()
        return [isa for isa in ("avx512", "avx2") if _X86_FEATURES[isa] <= flags] + ["generic"]
    if machine in ("aarch64", "arm64"):
        return ["neon", "generic"]
    return ["generic"]


def chosen_isa() -> str | None:
    """The build the setting asks for on this machine, or None for torch's ops."""
    return _chosen(os.environ.get(SETTING, "auto").strip().lower() or "auto")


@functools.cache
def _chosen(wanted: str) -> str | None:
    runnable = executable_isas()
    if wanted == "off":
        return None
    if wanted == "auto":
        best = runnable[0]
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        return None if best == "generic" and x86 else best  # x86 below AVX2: torch's ops
    if wanted not in ISAS:
        raise UserError(f"{SETTING}={wanted!r}: expected auto, off or one of "
                        f"{', '.join(ISAS)}")
    if wanted not in runnable:
        raise UserError(f"{SETTING}={wanted}: this CPU cannot execute that build "
                        f"(it executes {', '.join(runnable)})")
    return wanted


def unavailable_reason(isa: str | None = None) -> str | None:
    """Why this machine cannot run our kernels (the chosen build, or ``isa``), or None."""
    isa = chosen_isa() if isa is None else isa
    if isa is None:
        return f"{SETTING} chose torch's ops on this CPU ({', '.join(executable_isas())})"
    if isa not in executable_isas():
        return f"this CPU cannot execute the {isa} build"
    if compiler() is None:
        return "no C compiler (cc or gcc) on PATH"
    return None


def library(name: str, isa: str | None = None) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` built for ``isa`` (default: the chosen build) and loaded, built on
    first use; None (logged once) where it cannot be built or loaded."""
    return _library(name, chosen_isa() if isa is None else isa)


@functools.cache
def _library(name: str, isa: str | None) -> ctypes.CDLL | None:
    reason = unavailable_reason(isa)
    if reason is None:
        try:
            lib = _load(SOURCES / f"{name}.c", compiler(), isa)
            log.info("CPU kernels: %s built for %s", name, isa)
            return lib
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or ""
            reason = f"building {name}.c for {isa} failed: {e} {detail[-500:]}".strip()
    log.info("CPU kernels: torch's ops (our %s kernel is unavailable: %s)", name, reason)
    return None


@functools.cache
def _compiler_version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0] if out.stdout else cc


def _load(source: Path, cc: str, isa: str) -> ctypes.CDLL:
    flags = COMMON_FLAGS + ISAS[isa]
    headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    stamp = " ".join((_compiler_version(cc), platform.machine(), *flags))
    key = hashlib.sha256(source.read_bytes() + headers + stamp.encode()).hexdigest()
    folder = cache_dir() / "kernels"
    target = folder / f"{source.stem}-{isa}-{key[:16]}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], check=True,
                           capture_output=True, text=True)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))
