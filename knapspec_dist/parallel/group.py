"""The process group of one TP replica: gloo on CPUs, NCCL on GPUs, joined and left together."""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port free right now on this host (rank 0 picks it; tiny race, retried by callers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world: int, address: str, port: int, *, device: str = "cpu",
                     backend: str | None = None, timeout_s: float = 300.0):
    """Join the default process group: gloo on CPU, NCCL on CUDA. Returns the group (WORLD).

    ``timeout_s`` bounds how long a collective waits for a lagging rank; it must exceed the
    longest compute between two collectives (one sublayer of a prefill), so minutes is safe.
    """
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    log.info("rank %d/%d joined %s group at %s:%d", rank, world, backend, address, port)
    return dist.group.WORLD


def destroy_distributed(timeout_s: float = 300.0) -> None:
    """Leave the default process group together with the other ranks, then destroy it.

    Destroying a gloo group closes its TCP pairs and stops its worker threads. A rank that
    does so while a peer is still finishing the last collective (a ring all-reduce completes
    on one rank before the other has read its last chunk) breaks the peer's connection
    mid-operation, and on a busy machine that peer then aborts ("terminate called without an
    active exception"). So every rank first passes a barrier, then waits on the store until
    every rank has left it: only then is no collective in flight anywhere, and each rank
    destroys its group. Best effort: a peer that is gone already only costs the wait.
    """
    if not dist.is_initialized():
        return
    world = dist.get_world_size()
    if world > 1:
        try:
            dist.barrier()
            store = dist.distributed_c10d._get_default_store()
            store.add("knapspec/teardown", 1)
            deadline = time.monotonic() + timeout_s
            while store.add("knapspec/teardown", 0) < world and time.monotonic() < deadline:
                time.sleep(0.01)
        except Exception as e:  # noqa: BLE001 - a dead peer: destroy anyway
            log.warning("leaving the process group without the other ranks: %s", e)
    dist.destroy_process_group()
