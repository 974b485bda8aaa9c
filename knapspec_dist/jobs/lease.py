"""One writer per output directory: a lease file the running job holds and refreshes.

``DIR/.lease.json`` names the job that writes ``DIR``: its run id, host, pid (and the pid's
start time, so a reused pid is not mistaken for the job), when it started and its last
heartbeat, refreshed every :data:`HEARTBEAT_S` seconds by a thread of the job.

* Locally the lease is taken by an exclusive create (``O_CREAT | O_EXCL``): of two jobs
  started together exactly one gets it. The other is refused with one line naming the
  holder (a :class:`UserError`: exit 2, nothing written).
* A stale lease is taken over with a warning: on this host, when its process is gone (a
  SIGKILL, a crash: at once); from another host, when its heartbeat is older than
  :data:`STALE_S` seconds. Take-over moves the stale file aside (one rename succeeds) and
  creates the lease again exclusively.
* On object stores (any pyarrow filesystem but the local one) there is no exclusive create:
  the lease object is written when absent and read back after a moment to check that it is
  ours. That is best effort: two jobs started within the same moment may both believe they
  hold it. Run one job per output there.
* The lease is released (deleted, if still ours) when the job ends, also on SIGTERM, Ctrl-C
  and exceptions; a lease found to be someone else's while the job runs (it was taken over
  as stale) stops the job at its next tick (:meth:`Lease.check`).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import threading
import time
import uuid

import psutil
import pyarrow.fs as pafs

from knapspec_dist.errors import UserError

log = logging.getLogger(__name__)

LEASE_FILE = ".lease.json"
STALE_S = 60.0  # a lease without a heartbeat this long (another host) is stale
HEARTBEAT_S = 5.0
SETTLE_S = 0.5  # object stores: wait before reading the lease back


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


def _process_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def process_alive(pid: int, started: float | None) -> bool:
    """Whether ``pid`` runs on this host and is the process that started at ``started``."""
    try:
        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - float(started)) < 1.0
    except (psutil.NoSuchProcess, ValueError, TypeError):
        return False
    except (psutil.Error, OSError):  # no permission to look: it exists
        return True


class LeaseHeld(UserError):
    """Another live job holds the output directory."""


class Lease:
    """The lease on one :class:`~knapspec_dist.jobs.output.OutputDir` (see the module)."""

    def __init__(self, out, *, stale_s: float = STALE_S, heartbeat_s: float = HEARTBEAT_S):
        self.out = out
        self.path = out.join(LEASE_FILE)
        self.stale_s, self.heartbeat_s = stale_s, heartbeat_s
        now = time.time()
        self.run_id = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + \
            f"-{uuid.uuid4().hex[:6]}"
        self.info = {"run": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
                     "pid_started": _process_start(os.getpid()), "started_at": _iso(now),
                     "heartbeat": now, "heartbeat_at": _iso(now)}
        self.held = False
        self.lost: str | None = None  # why the lease is no longer ours
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ take, keep, give back

    def acquire(self) -> None:
        """Take the lease (creating the directory if needed), or raise :class:`LeaseHeld`."""
        self.out.create()
        for _ in range(5):
            if self._create():
                break
            holder = self._read()
            if holder is None:  # gone between our create and our read: try again
                continue
            why = self.stale_reason(holder)
            if why is None:
                raise LeaseHeld(self.refusal(holder))
            log.warning("--output %s: taking over the lease of run %s (host %s, pid %s): %s",
                        self.out.display(), holder.get("run"), holder.get("host"),
                        holder.get("pid"), why)
            self._move_aside(holder)
        else:
            raise LeaseHeld(f"--output {self.out.uri!r}: could not take its lease "
                            f"{self.out.display(LEASE_FILE)} (other jobs keep taking it)")
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="knapspec-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise if another job took the lease over while this one ran."""
        if self.lost:
            raise UserError(f"--output {self.out.uri!r}: {self.lost}; stopping so that only "
                            "one job writes there (the rows written so far are kept)")

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if not self.held:
            return
        self.held = False
        try:
            holder = self._read()
            if holder is not None and holder.get("run") == self.run_id:
                self.out.fs.delete_file(self.path)
        except OSError as e:
            log.warning("could not release the lease %s: %s", self.out.display(LEASE_FILE), e)

    def refresh(self) -> None:
        """Write a new heartbeat (if the lease is still ours)."""
        holder = self._read()
        if holder is None or holder.get("run") != self.run_id:
            if not self.lost:
                self.lost = (f"its lease was taken over by run "
                             f"{(holder or {}).get('run')} (host {(holder or {}).get('host')}, "
                             f"pid {(holder or {}).get('pid')})")
                log.error("--output %s: %s", self.out.display(), self.lost)
            return
        now = time.time()
        self.info.update(heartbeat=now, heartbeat_at=_iso(now))
        self._write(self.path)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - a missed heartbeat is not fatal
                log.warning("lease heartbeat failed: %s", e)
            if self.lost:
                return

    # ------------------------------------------------------------------ judging a holder

    def stale_reason(self, holder: dict) -> str | None:
        """Why ``holder``'s lease may be taken over, or None when its job looks alive."""
        pid = holder.get("pid")
        if holder.get("host") == self.info["host"] and pid is not None:
            if not process_alive(pid, holder.get("pid_started")):
                return f"its process {pid} is not running on this host"
            return None  # alive here: never taken over, however old its heartbeat
        age = time.time() - float(holder.get("heartbeat") or 0)
        if age > self.stale_s:
            return f"no heartbeat for {age:.0f} s (more than {self.stale_s:.0f} s)"
        return None

    def refusal(self, holder: dict) -> str:
        age = max(0.0, time.time() - float(holder.get("heartbeat") or 0))
        return (f"--output {self.out.uri!r} is in use by another job (run {holder.get('run')}, "
                f"host {holder.get('host')}, pid {holder.get('pid')}, heartbeat {age:.0f} s "
                f"ago); wait for it to finish or stop it (its lease "
                f"{self.out.display(LEASE_FILE)} is taken over once its process is gone, or "
                f"after {self.stale_s:.0f} s without a heartbeat)")

    # ------------------------------------------------------------------ files

    def _data(self) -> bytes:
        return json.dumps(self.info, indent=2).encode() + b"\n"

    def _create(self) -> bool:
        """Create the lease if there is none; True when it is ours."""
        if self.out.local:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            except OSError as e:
                raise UserError(f"--output {self.out.uri!r}: cannot write there: "
                                f"{e.strerror or e}") from None
            with os.fdopen(fd, "wb") as f:
                f.write(self._data())
                f.flush()
                os.fsync(f.fileno())
            return True
        fs = self.out.fs
        if fs.get_file_info(self.path).type != pafs.FileType.NotFound:
            return False
        self.out.call(lambda: self._write(self.path))
        time.sleep(SETTLE_S)  # a concurrent writer's object would have landed by now
        holder = self._read()
        return holder is not None and holder.get("run") == self.run_id

    def _write(self, path: str) -> None:
        if self.out.local:  # atomic: readers never see a torn lease
            tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
            with open(tmp, "wb") as f:
                f.write(self._data())
            os.replace(tmp, path)
        else:
            with self.out.fs.open_output_stream(path) as f:
                f.write(self._data())

    def _read(self) -> dict | None:
        """The lease's content; None when there is none. A torn or unreadable lease reads as
        one without a process whose heartbeat is its modification time."""
        fs = self.out.fs
        try:
            info = fs.get_file_info(self.path)
            if info.type == pafs.FileType.NotFound:
                return None
            with fs.open_input_stream(self.path) as f:
                data = json.loads(f.read().decode())
            if isinstance(data, dict):
                return data
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError):
            pass
        mtime = info.mtime.timestamp() if getattr(info, "mtime", None) else 0.0
        return {"run": "(unreadable lease)", "host": None, "pid": None, "heartbeat": mtime}

    def _move_aside(self, holder: dict) -> None:
        """Remove a stale lease; if it turns out not to be the one judged stale (another job
        took it over meanwhile), it is put back."""
        aside = f"{self.path}.stale-{uuid.uuid4().hex[:8]}"
        fs = self.out.fs
        try:
            fs.move(self.path, aside)
        except (FileNotFoundError, OSError):
            return  # someone else moved it first: try again from the start
        try:
            with fs.open_input_stream(aside) as f:
                moved = json.loads(f.read().decode())
        except (OSError, ValueError, UnicodeDecodeError):
            moved = None
        if (isinstance(moved, dict) and holder.get("run") != "(unreadable lease)"
                and moved.get("run") != holder.get("run")):
            if fs.get_file_info(self.path).type == pafs.FileType.NotFound:
                fs.move(aside, self.path)  # a live job's fresh lease: give it back
                return
        fs.delete_file(aside)
