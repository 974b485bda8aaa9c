"""The one place this process joins or starts Ray, and leaves it again."""

from __future__ import annotations

import logging

import ray

log = logging.getLogger(__name__)
RAY_AUTH_LOG = "ray._private.authentication.authentication_token_setup"


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


def connect(address: str | None, *, num_cpus: int | None = None) -> bool:
    """Join the cluster at ``address`` unless Ray is already initialized in this process.

    ``"auto"`` joins a running cluster, ``"local"`` always starts a new one, None is Ray's
    default (RAY_ADDRESS, e.g. under ``ray job submit``, else a cluster ``ray start`` left on
    this machine, else a new local one). ``num_cpus``: the CPUs a Ray started here offers
    (default: the machine's). True when this call connected, so the caller owns the
    connection and ends it with :func:`disconnect`."""
    if ray.is_initialized():
        if address is not None:
            log.info("Ray is already initialized; ignoring address=%r", address)
        return False
    logging.getLogger(RAY_AUTH_LOG).addFilter(_AUTH_FILTER)  # idempotent
    ray.init(address=address, num_cpus=num_cpus, log_to_driver=True)
    return True


def disconnect() -> None:
    """End the connection :func:`connect` made (and the local Ray it may have started)."""
    ray.shutdown()
