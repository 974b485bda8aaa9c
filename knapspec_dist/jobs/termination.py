"""``ray job stop``: SIGTERM becomes a flag the job's loop turns into :class:`JobTerminated`,
so the finished rows are written before the SIGKILL that follows."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("knapspec_dist.jobs.runner")  # the job's log lines, as before


class JobTerminated(BaseException):
    """SIGTERM (``ray job stop``); a BaseException so that no row swallows it as its error."""


TERMINATE = threading.Event()


def install_sigterm():
    """``ray job stop`` sends SIGTERM, then SIGKILL 3 s later (RAY_JOB_STOP_WAIT_TIME_S).

    The handler only sets a flag: raising from it could land inside Ray's C++ calls (they
    turn it into a SystemError).  The dispatcher's loop wakes at least once a second and
    raises :class:`JobTerminated` from Python, so the finished rows get written in time.
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        if not TERMINATE.is_set():
            log.warning("SIGTERM: stopping; the finished rows are written before exiting")
        TERMINATE.set()
    return signal.signal(signal.SIGTERM, handler)


def check_terminate() -> None:
    if TERMINATE.is_set():
        raise JobTerminated()


def restore_sigterm(previous) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)
    TERMINATE.clear()
