"""Who measured: the device identity a latency profile records (and is keyed by)."""

from __future__ import annotations

import logging
import os
import platform
from typing import Any

import torch

from knapspec_dist.model.kernels.build import chosen_isa

try:
    import pynvml
except ImportError:  # NVML is optional: torch's device name is still a real identity
    pynvml = None

log = logging.getLogger(__name__)

#: A CPU measurement beside more other load than this many times the logical CPUs was busy.
LOAD_LIMIT = 0.75
#: ... or beside more than this many CPUs of other load once its own threads fill the CPUs.
SPARE_LOAD = 0.75


def device_info(device: torch.device | str) -> dict[str, Any]:
    """Who measured: NVML name and memory on NVIDIA GPUs; CPU model and thread count otherwise.

    On a CPU the thread count is part of ``name`` (hence of the profile key): a profile taken
    with 2 threads says nothing about 16. So are the vector unit (``isa``: one CPU model name
    covers AVX2-only and AVX-512 parts) and the build of our kernels that runs
    (``kernels``, model/kernels/build.py): each can change a CPU's speed twofold.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_info(device)
    threads = torch.get_num_threads()
    model = cpu_model_name()
    info: dict[str, Any] = {"kind": "cpu", "name": f"{model} ({threads} threads)",
                            "cpu_model": model, "threads": threads, "logical_cpus": os.cpu_count(),
                            "machine": platform.machine(), "kernels": chosen_isa() or "torch"}
    info.update(_cpuinfo_details())
    return info


def other_load(info: dict[str, Any]) -> float | None:
    """The load beside a CPU measurement, from the 1-minute load average it recorded before and
    after (``info["load_average"]``): the larger of the one before and the one after less the
    measuring threads' own, which count in the average while they run. None: not recorded."""
    load = info.get("load_average")
    if not isinstance(load, list) or not load:
        return None
    after = load[-1] - info.get("threads", 0) if len(load) > 1 else load[0]
    return max(load[0], after)


def cpu_busy(info: dict[str, Any]) -> str | None:
    """Why a CPU measurement ran on a busy machine, or None: the load beside it
    (:func:`other_load`) above ``LOAD_LIMIT`` x the logical CPUs, or above ``SPARE_LOAD``
    more than the CPUs its threads leave idle: one busy process beside two threads on two
    cores adds 1.0 and halves their speed; the profiler's own model load, in the minute
    before its first reading, about 0.6."""
    cpus, other = info.get("logical_cpus"), other_load(info)
    if info.get("kind") != "cpu" or not cpus or other is None:
        return None
    limit = min(LOAD_LIMIT * cpus, max(cpus - info.get("threads", 0), 0) + SPARE_LOAD)
    if other <= limit:
        return None
    load = info["load_average"]
    return (f"the load beside the measurement was {other:.1f} on {cpus} CPUs (> {limit:.1f}; "
            f"load average {' -> '.join(f'{x:.1f}' for x in load)}, less its own "
            f"{info.get('threads', 0)} threads after)")


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cpuinfo_details() -> dict[str, Any]:
    """Family/model/stepping and the vector ISA flags that decide CPU matmul speed."""
    out: dict[str, Any] = {}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read().split("\n\n", 1)[0]
    except OSError:
        return out
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    for key, name in (("cpu family", "cpu_family"), ("model", "cpu_model_id"),
                      ("stepping", "stepping")):
        if key in fields:
            out[name] = fields[key]
    flags = set(fields.get("flags", "").split())
    out["isa"] = sorted(flags & {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni",
                                  "amx_bf16", "amx_tile", "neon", "asimd"})
    return out


def _cuda_info(device: torch.device) -> dict[str, Any]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    info: dict[str, Any] = {"kind": "cuda", "name": props.name,
                            "memory_bytes": int(props.total_memory),
                            "capability": f"{props.major}.{props.minor}",
                            "multiprocessors": props.multi_processor_count, "source": "torch"}
    if pynvml is None:
        log.warning("NVML unavailable (no pynvml); device name from torch")
        return info
    try:
        pynvml.nvmlInit()
        try:
            handle = None
            uuid = getattr(props, "uuid", None)
            if uuid is not None:  # NVML indices ignore CUDA_VISIBLE_DEVICES; UUIDs do not
                try:
                    handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
                except pynvml.NVMLError:
                    handle = None
            if handle is None:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            info["name"] = name.decode() if isinstance(name, bytes) else name
            info["memory_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            driver = pynvml.nvmlSystemGetDriverVersion()
            info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
            try:
                info["max_sm_clock_mhz"] = int(
                    pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
            except pynvml.NVMLError:
                pass
            info["source"] = "nvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # NVML missing or unusable: torch's name is still a real identity
        log.warning("NVML unavailable (%s); device name from torch", e)
    return info
