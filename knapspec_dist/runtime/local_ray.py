"""The keeper of a local Ray that a job starts for itself (runtime/cluster.py ``LocalRay``).

Run as a script (``python local_ray.py [--num-cpus N]``), in a session of its own: it starts
Ray with ``ray.init(address="local")``, so that Ray's processes (GCS, raylet, dashboard,
agents, workers) are in the keeper's session and process group, not the job's. A signal to
the job's process group (Ctrl-C, ``timeout``, a scheduler's cancel, a container stop) then
reaches the job alone, which stops its work on a cluster that is still there.

It prints one JSON line (``address``, ``session_dir``) on stdout once Ray is up, then waits
for the job to go: its stdin (a pipe only the job writes to) reaching end of file, or its
parent changing. Either way (a clean end, a crash, SIGKILL) it shuts Ray down and then ends
whatever process of its session is still there (Ray's agents outlive a raylet killed hard),
so a job leaves no Ray process behind. It imports only the standard library
and ``ray`` (not this package, whose import loads torch).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import select
import signal
import sys
import threading
import time

import ray

log = logging.getLogger("knapspec_dist.runtime.local_ray")
RAY_AUTH_LOG = "ray._private.authentication.authentication_token_setup"

PR_SET_CHILD_SUBREAPER = 36  # orphaned Ray processes are reparented here and reaped
POLL_S = 0.5  # how often the keeper looks at its parent
GRACE_S = 1.0  # how long what is left of Ray gets to exit after SIGTERM, before SIGKILL
KILL_WAIT_S = 5.0  # ... and to be gone after SIGKILL


def session_members(sid: int, exclude: int | None = None) -> list[int]:
    """Live (not zombie) processes of session ``sid``, from /proc (empty where there is none)."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == exclude:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # the name may hold spaces and ")"
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(entry))
    return members


def _reap() -> None:
    """Collect the exit status of every child that ended (orphans included, as subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def sweep(sid: int) -> list[int]:
    """End every process of session ``sid`` (this keeper's) still there after Ray's shutdown
    (the dashboard's forkserver waits for a signal; agents outlive a raylet killed hard):
    SIGTERM, a grace period, then SIGKILL; returns those that survived even that."""
    me = os.getpid()
    left = session_members(sid, me)
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
        for pid in left:
            try:
                os.kill(pid, sig)
            except OSError:  # gone meanwhile
                pass
        deadline = time.monotonic() + wait_s
        while (left := session_members(sid, me)) and time.monotonic() < deadline:
            _reap()
            time.sleep(0.05)
        if not left:
            break
    _reap()
    return left


def _become_subreaper() -> None:
    """Linux: orphans of this process tree are reparented here, not to init (which may not
    reap them in a container), so none is left a zombie."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def wait_for_parent(parent: int, stop: threading.Event) -> None:
    """Until stdin ends (the job closed it or died), the parent changes, or a signal came."""
    while not stop.is_set() and os.getppid() == parent:
        try:
            ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        except InterruptedError:
            continue
        if ready and not os.read(sys.stdin.fileno(), 4096):
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-cpus", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    stop = threading.Event()
    # the pipe to the job carries one line, the address: anything else printed here (and
    # what Ray's processes inherit) goes to stderr
    to_job = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def handler(signum, frame):
        stop.set()

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, handler)
    _become_subreaper()
    # Ray's notice that it turned token auth on by default: the job says it (at INFO) as it
    # connects, and a user has nothing to do about it
    logging.getLogger(RAY_AUTH_LOG).setLevel(logging.ERROR)
    try:  # whatever happens from here on (a failed start, the job gone), Ray is ended
        context = ray.init(address="local", num_cpus=args.num_cpus, log_to_driver=False,
                           logging_level=logging.WARNING)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # ray.init set its own
            signal.signal(s, handler)
        info = context.address_info
        to_job.write(json.dumps({"address": info["gcs_address"],
                                 "session_dir": info.get("session_dir")}) + "\n")
        to_job.close()  # BrokenPipeError where the job is gone already
        wait_for_parent(parent, stop)
    finally:
        ray.shutdown()
        left = sweep(os.getsid(0))
        if left:
            log.warning("local Ray: processes %s of its session outlived SIGKILL", left)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # nothing is left to tear down: the interpreter's own teardown takes seconds
