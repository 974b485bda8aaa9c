"""The one place this process joins or starts Ray, and leaves it again.

A Ray this process starts (no cluster to join) runs in a session of its own, under a keeper
(runtime/local_ray.py), not as children of this process: a signal to this process's group
(Ctrl-C, ``timeout``, a scheduler's cancel) then stops the job on a Ray that is still up,
instead of killing Ray's GCS under it, and the keeper ends that Ray when this process ends,
however it ends (SIGKILL included).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import ray
from ray._private import services
from ray._private.authentication.authentication_token_setup import (
    maybe_enable_token_auth_if_token_available,
)

log = logging.getLogger(__name__)
RAY_AUTH_LOG = "ray._private.authentication.authentication_token_setup"
KEEPER = Path(__file__).with_name("local_ray.py")
KEEPER_STOP_S = 15.0  # how long disconnect() waits for the local Ray to end


class _TokenAuthDefaultIsInfo(logging.Filter):
    """Ray warns, at every new local cluster, that it turned its token authentication on by
    default. That is the secure default working as designed, not something a user must act
    on, so it is logged at INFO (a warning that token auth is *disabled* stays a warning)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and "Token authentication is enabled" in str(
                record.msg):
            record.levelno, record.levelname = logging.INFO, "INFO"
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True


_AUTH_FILTER = _TokenAuthDefaultIsInfo()


class LocalRay:
    """A new local Ray in a session of its own, kept by runtime/local_ray.py until
    :meth:`stop` or this process's end; ``address`` is its GCS."""

    def __init__(self, num_cpus: int | None = None):
        cmd = [sys.executable, "-P", str(KEEPER)]
        if num_cpus is not None:
            cmd += ["--num-cpus", str(num_cpus)]
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        start_new_session=True, text=True)
        try:
            line = self.process.stdout.readline()
        except BaseException:  # a second Ctrl-C while Ray starts: the keeper ends it
            self.process.stdin.close()
            raise
        self.process.stdout.close()
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"the local Ray did not start (its keeper exited with code "
                               f"{code}; see its lines above)")
        info = json.loads(line)
        self.address: str = info["address"]
        self.session_dir: str | None = info.get("session_dir")

    @property
    def session(self) -> int:
        """The session id of the keeper and of every process of this Ray."""
        return self.process.pid

    def stop(self, timeout_s: float = KEEPER_STOP_S) -> None:
        """End this Ray (its keeper shuts it down once its stdin closes) and wait for it."""
        if not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the local Ray (session %d) is still shutting down after %.0fs",
                        self.session, timeout_s)


_LOCAL: list[LocalRay] = []  # the Ray connect() started, until disconnect()


def connect(address: str | None, *, num_cpus: int | None = None) -> bool:
    """Join the cluster at ``address`` unless Ray is already initialized in this process.

    ``"auto"`` joins a running cluster, ``"local"`` always starts a new one, None is Ray's
    default (RAY_ADDRESS, e.g. under ``ray job submit``, else a cluster ``ray start`` left on
    this machine, else a new local one). A new one is a :class:`LocalRay`. ``num_cpus``: the
    CPUs a Ray started here offers (default: the machine's). True when this call connected,
    so the caller owns the connection and ends it with :func:`disconnect`."""
    if ray.is_initialized():
        if address is not None:
            log.info("Ray is already initialized; ignoring address=%r", address)
        return False
    logging.getLogger(RAY_AUTH_LOG).addFilter(_AUTH_FILTER)  # idempotent
    if services.canonicalize_bootstrap_address(address) is not None:  # as ray.init decides
        ray.init(address=address, num_cpus=num_cpus, log_to_driver=True)
        return True
    local = LocalRay(num_cpus)
    try:
        # the token auth the new cluster turned on by default, as ray.init turns it on for a
        # cluster it finds itself (it never does for an address it is given)
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        ray.init(address=local.address, log_to_driver=True)
    except BaseException:
        local.stop()
        raise
    log.info("started a local Ray (session %d, logs in %s)", local.session, local.session_dir)
    _LOCAL.append(local)
    return True


def disconnect() -> None:
    """End the connection :func:`connect` made, and the local Ray it may have started."""
    ray.shutdown()
    while _LOCAL:
        _LOCAL.pop().stop()
