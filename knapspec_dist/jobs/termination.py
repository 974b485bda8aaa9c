"""``ray job stop`` and Ctrl-C: SIGTERM and SIGINT become a flag the job's loop turns into
:class:`JobTerminated`, so the finished rows are written before the process exits (and
before the SIGKILL that follows ``ray job stop``).

The command line (``knapspec job``, ``jobs/summarize.py``) turns it into one warning line
and exit code 128 + the signal: 143 for SIGTERM, 130 for SIGINT (:func:`exit_code`).
"""

from __future__ import annotations

import signal
import threading

from knapspec_dist.errors import Stopped


class JobTerminated(Stopped):
    """SIGTERM (``ray job stop``) or SIGINT (Ctrl-C) stopped the job."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)


TERMINATE = threading.Event()
_SIGNAL = [int(signal.SIGTERM)]  # the first signal received (its exit code)
HANDLED = (signal.SIGTERM, signal.SIGINT)


exit_code = Stopped.exit_code


def install_sigterm():
    """``ray job stop`` sends SIGTERM, then SIGKILL 3 s later (RAY_JOB_STOP_WAIT_TIME_S);
    Ctrl-C sends SIGINT.  Both are handled alike; returns the previous handlers.

    The handler only sets a flag: raising from it could land inside Ray's C++ calls (they
    turn it into a SystemError).  The dispatcher's loop wakes at least once a second and
    raises :class:`JobTerminated` from Python, so the finished rows get written in time.
    It logs nothing: the command line says once, on the way out, that the job stopped and
    how to continue.  A second SIGINT while stopping raises KeyboardInterrupt at once (the
    command line still exits 130 without a traceback), for a user who does not want to wait
    (e.g. while a replica loads its weights, before the loop runs).
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        if TERMINATE.is_set():
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        _SIGNAL[0] = int(signum)
        TERMINATE.set()
    return {s: signal.signal(s, handler) for s in HANDLED}


def check_terminate() -> None:
    if TERMINATE.is_set():
        raise JobTerminated(_SIGNAL[0])


def restore_sigterm(previous) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        for s, h in previous.items():
            signal.signal(s, h)
    TERMINATE.clear()
