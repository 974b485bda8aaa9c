"""gpu-check never loses a run: each measured row is isolated, results are saved after every
row, and a CUDA error that poisons the context stops only the sections after it.

A GPU comes rarely and for minutes, so one failing measurement (a compile error, a capture
that asserts) must cost that row, not the run. ``Rows.add`` turns a row's exception into its
status (the error's first line) and goes on. A device-side assert or any other "CUDA error"
leaves the CUDA context unusable: every later CUDA call fails. Such an error is raised as
``DevicePoisoned``, and ``run_sections`` marks the sections after it as skipped, with the
reason. Each section's record also holds what torch.compile did in it (graphs compiled and
seconds, from torch._dynamo's counters): the budget pays for that time, and the report shows
where it went.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._dynamo import utils as dynamo_utils

from knapspec_dist.errors import first_line
from knapspec_dist.tools.gpucheck.budget import Budget, Section, Spent

log = logging.getLogger(__name__)

# Messages of errors after which the CUDA context is unusable (sticky errors).
POISON_MARKS = ("device-side assert", "cuda error", "illegal memory access",
                "unspecified launch failure")


class DevicePoisoned(RuntimeError):
    """A CUDA error left the context unusable: nothing more can run on the device."""


def poisons(e: BaseException) -> bool:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    text = f"{type(e).__name__}: {e}".lower()
    return any(mark in text for mark in POISON_MARKS)


def error_line(e: BaseException) -> str:
    """The exception's type and first non-empty line: what a table cell can hold."""
    return f"{type(e).__name__}: {first_line(e) if str(e).strip() else ''}"[:300]


def where_from(e: BaseException, frames: int = 6) -> list[str]:
    """The innermost frames of the traceback (file:line in function): where to look first,
    kept in the JSON, which may be all that comes back from the GPU machine."""
    stack = traceback.extract_tb(e.__traceback__)[-frames:]
    return [f"{f.filename}:{f.lineno} in {f.name}" for f in stack]


def status_of(e: BaseException) -> str:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "out of memory"
    return "error: " + error_line(e)


def compile_stats() -> tuple[int, float]:
    """Graphs torch.compile made in this process so far, and the seconds it spent on them.
    Dynamo times each compile with nested timers, whose names vary between torch versions;
    the outermost one (the largest total) holds the whole compile, inductor included."""
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    timers = getattr(dynamo_utils, "compilation_time_metrics", {})
    return graphs, max((sum(v) for v in timers.values()), default=0.0)


@dataclass
class Tally:
    ok: int = 0
    failed: int = 0
    skipped: int = 0


@dataclass
class Rows:
    """Appends rows to the document's tables, one measurement at a time, and saves after each."""

    save: Callable[[], object]  # writes the results (the JSON) after every row
    save_section: Callable[[], object] | None = None  # and after a section (the report too)
    section: str = ""
    tallies: dict[str, Tally] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # "section: row: error", for the summary

    def _put(self, table: list, row: dict, kind: str) -> dict:
        table.append(row)
        tally = self.tallies.setdefault(self.section, Tally())
        setattr(tally, kind, getattr(tally, kind) + 1)
        self.save()
        return row

    def skip(self, table: list, base: dict, why: str) -> None:
        self._put(table, {**base, "status": why}, "skipped")

    def add(self, table: list, base: dict, measure: Callable[[], dict],
            section: Section | None = None, need_s: float = 0.0) -> dict | None:
        """``base`` plus what ``measure()`` returns as one row of ``table`` (status "ok"); if
        ``section`` has less than ``need_s`` left, the row says it was skipped; if ``measure``
        raises, the row holds the error (``Spent``: the row was cut for time, and counts as
        skipped). Returns the row when it was measured, else None.
        Raises DevicePoisoned (after saving the row) when the error poisoned the device."""
        if section is not None and (why := section.over(need_s)) is not None:
            self.skip(table, base, why)
            return None
        try:
            fields = measure()
        except Spent as e:
            self.skip(table, base, str(e))
            return None
        except Exception as e:  # noqa: BLE001 - the point: a row's failure is its status
            self._put(table, {**base, "status": status_of(e), "where": where_from(e)},
                      "failed")
            self._failed(", ".join(f"{k} {v}" for k, v in base.items()
                                   if not isinstance(v, float)), e)
            return None
        return self._put(table, {**base, "status": "ok", **fields}, "ok")

    def attempt(self, notes: list, what: str, make: Callable[[], object]):
        """``make()`` for what later rows need (a model, a profile), or None when it raised:
        the error becomes a note and the rows that need it say so themselves."""
        try:
            return make()
        except Exception as e:  # noqa: BLE001 - see add
            notes.append(f"{what}: {status_of(e)}")
            self._failed(what, e)
            return None

    def _failed(self, where: str, e: Exception) -> None:
        self.errors.append(f"{self.section}: {where}: {error_line(e)}")
        log.warning("%s: %s failed: %s", self.section, where, error_line(e), exc_info=e)
        if poisons(e):
            raise DevicePoisoned(f"{where}: {error_line(e)}") from e


def run_sections(steps: list[tuple[str, Callable[[Section], None] | str]], budget: Budget,
                 rows: Rows, record: dict) -> str | None:
    """Runs each (name, step) in its share of ``budget``, in order, writing into ``record`` per
    section: status, wall and compile seconds, compiles, rows ok / failed / skipped. A step
    given as a string is skipped for that reason. A step's own exception ends that section
    only; a poisoned device ends every later one. A section whose share ran out before its
    last row has status "cut" and the first reason in "cut". Returns why the run stopped
    early, or None."""
    stopped = None
    for name, step in steps:
        if stopped is not None or isinstance(step, str):
            record[name] = {"status": f"skipped: {stopped or step}"}
            continue
        rows.section = name
        section = budget.section(name)
        graphs, compile_s = compile_stats()
        start = time.perf_counter()
        status, where = "ok", None
        try:
            step(section)
        except Spent:  # a measurement outside Rows.add ran out of time: the section ends
            pass
        except Exception as e:  # noqa: BLE001 - a section's failure is its status
            where = where_from(e.__cause__ if isinstance(e, DevicePoisoned) else e)
            if isinstance(e, DevicePoisoned) or poisons(e):
                detail = str(e) if isinstance(e, DevicePoisoned) else error_line(e)
                status = f"stopped: the CUDA context is poisoned ({detail})"
                stopped = f"a CUDA error in section {name} poisoned the device context ({detail})"
                log.error("%s: %s; the sections after it are skipped", name, detail)
            else:
                status = "error: " + error_line(e)
                rows.errors.append(f"{name}: {error_line(e)}")
                log.exception("section %s failed; the check goes on", name)
        if status == "ok" and section.cut:
            status = "cut"
        now_graphs, now_s = compile_stats()
        tally = rows.tallies.get(name, Tally())
        record[name] = {"status": status, "wall_s": time.perf_counter() - start,
                        "budget_s": section.seconds, "compiles": now_graphs - graphs,
                        "compile_s": now_s - compile_s, "rows_ok": tally.ok,
                        "rows_failed": tally.failed, "rows_skipped": tally.skipped,
                        **({"where": where} if where else {}),
                        **({"cut": section.cut} if section.cut else {})}
        (rows.save_section or rows.save)()
    return stopped
