"""The rules of every numeric option, in one table (``RULES``), applied where options are
parsed: as the argparse ``type`` of each command-line option and by the configs the Python
API builds (``JobConfig``, ``ProcessorConfig``, ``SamplingConfig``, ``GenerationConfig``).

A value is a finite number of its kind, in its range, or a :class:`UserError` naming the
option and what it allows: one ``error:`` line and exit 2 from any command, before Ray starts
or a model loads. nan, inf, 1e400 (inf as a float), fractions where an integer is meant and
empty strings are refused alike. Sizes (``--kv-cache-memory``) are whole bytes (``300000000``)
or a number with a unit (``2GiB``, ``1.5GB``); a bare ``0.5`` or ``1e3`` is refused rather
than read as some number of bytes.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable
from dataclasses import dataclass

from knapspec_dist.errors import UserError

MAX_GAMMA = 16  # the longest draft: cache headroom per row beyond the generation limit
INT64 = 2 ** 63 - 1  # every integer option fits a tensor's int64

UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_SIZE = re.compile(r"([0-9.+-]*(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)")


@dataclass(frozen=True)
class Rule:
    """One numeric option: ``kind`` ``int``, ``float`` or ``size`` (bytes), within
    [``low``, ``high``] (an end ``None``: unbounded; ``open_low``: ``low`` excluded)."""

    option: str
    kind: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False

    def allowed(self) -> str:
        """What the option takes, in the words of its error."""
        if self.kind == "size":
            return "a size in whole bytes or with a unit (2GiB, 500MB), at least 1 byte"
        what = "an integer" if self.kind == "int" else "a finite number"
        if self.low is not None and self.high is not None:
            if self.kind == "int":
                return f"{what} in {self.low:g}..{self.high:g}"
            return f"{what} in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"{what} {'>' if self.open_low else '>='} {self.low:g}"
        return what

    def __call__(self, value):
        """``value`` (a string as typed, or a number) as this option's int or float; a
        UserError when it is not one, or out of range. The argparse ``type`` of the option."""
        number = self._number(value)
        if number is None or not self._in_range(number):
            raise UserError(f"{self.option} must be {self.allowed()}, got {value!r}")
        return number

    def _number(self, value) -> int | float | None:
        if isinstance(value, bool):
            return None
        if isinstance(value, str):
            return self._parse(value.strip())
        if self.kind in ("int", "size"):
            if isinstance(value, numbers.Integral):
                return int(value)
            if isinstance(value, float) and math.isfinite(value) and value.is_integer():
                return int(value) if self.kind == "size" else None
            return None
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
            return float(value)
        return None

    def _parse(self, text: str) -> int | float | None:
        if self.kind == "size":
            return parse_size(text)
        try:
            number = int(text, 10) if self.kind == "int" else float(text)
        except ValueError:
            return None
        return number if self.kind == "int" or math.isfinite(number) else None

    def _in_range(self, number: int | float) -> bool:
        if self.kind in ("int", "size") and not -INT64 <= number <= INT64:
            return False
        low, high = (1 if self.kind == "size" else self.low), self.high
        if low is not None and (number <= low if self.open_low else number < low):
            return False
        return high is None or number <= high


def parse_size(text: str) -> int | None:
    """Bytes of a size a user wrote (``2GiB``, ``1.5GB``, ``300000000``, ``512 MiB``): whole
    bytes, or a finite number with a unit (rounded down to bytes); None when it is neither."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        return None
    number, unit = m.group(1), m.group(2).lower()
    if unit not in UNITS:
        return None
    if unit in ("", "b"):  # bytes: a whole number only
        return int(number) if number.isdigit() else None
    try:
        value = float(number)
    except ValueError:
        return None
    return int(value * UNITS[unit]) if math.isfinite(value) and value >= 0 else None


def format_size(n: int) -> str:
    """``n`` bytes as the user may have written them, exact: ``1048576 bytes (1.0 MiB)``."""
    return f"{n} bytes" if n < 2 ** 20 else f"{n} bytes ({n / 2 ** 20:.1f} MiB)"


def _rule(line: str) -> Rule:
    """One row of ``TABLE``: the option, its kind and its range (``>= 1``, ``> 0``,
    ``[0, 1]``, ``(0, 1]``, ``1..16``; none for a size)."""
    option, kind, *rest = line.split(None, 2)
    bounds = rest[0] if rest else ""
    if m := re.fullmatch(r"(>=|>) (\S+)", bounds):
        return Rule(option, kind, float(m.group(2)), open_low=m.group(1) == ">")
    if m := re.fullmatch(r"([\[(])(\S+), (\S+)\]", bounds):
        return Rule(option, kind, float(m.group(2)), float(m.group(3)), m.group(1) == "(")
    if m := re.fullmatch(r"(\S+)\.\.(\S+)", bounds):
        return Rule(option, kind, int(m.group(1)), int(m.group(2)))
    if bounds:
        raise ValueError(f"option table: cannot read {line!r}")
    return Rule(option, kind)


#: Every numeric option of ``knapspec job`` / ``jobs/summarize.py``, ``generate``, ``bench``,
#: ``throughput``, ``demo``, ``peer``, the processor and ``run_job``; an option means the same
#: wherever it appears.
TABLE = f"""
--max-new-tokens          int    >= 1
--new-tokens              int    >= 1
--temperature             float  >= 0
--top-p                   float  (0, 1]
--top-k                   int    >= 0
--seed                    int    >= 0
--max-model-len           int    >= 2
--chunk-tokens            int    >= 1
--chunk-overlap           int    >= 0
--tree-depth              int    >= 2
--tree-fan-in             int    >= 2
--draws                   int    >= 1
--short-rows              int    >= 0
--gamma                   int    1..{MAX_GAMMA}
--tau-conf                float  [0, 1]
--interval                int    >= 1
--tp                      int    >= 1
--replicas                int    >= 1
--concurrency             int    >= 1
--cpus-per-rank           int    >= 1
--threads                 int    >= 1
--max-num-seqs            int    >= 1
--kv-cache-memory         size
--memory-utilization      float  (0, 1]
--max-num-batched-tokens  int    >= 1
--page-size               int    >= 1
--batch-size              int    >= 1
--baseline-fraction       float  [0, 1]
--max-inflight            int    >= 1
--max-attempts            int    >= 1
--row-timeout             float  > 0
--tokenizers              int    >= 1
--tokenizer-concurrency   int    >= 1
--tokenizer-cpus          float  >= 0
--stream-rows             int    >= 1
--checkpoint-rows         int    >= 1
--checkpoint-seconds      float  >= 0
--stop-after              int    >= 1
--progress-seconds        float  > 0
--prompts                 int    >= 1
--documents               int    >= 1
--repeats                 int    >= 1
"""
RULES: dict[str, Rule] = {r.option: r for r in map(_rule, TABLE.strip().splitlines())}


def rule(option: str) -> Rule:
    """The rule of ``option`` (``--temperature``): an argparse ``type``."""
    return RULES[option]


def option_of(field: str) -> str:
    """The command-line option of a config's field: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field.replace("_", "-")


def check(field: str, value):
    """``value`` of the config field ``field`` by its option's rule; None stays None (the
    field's default: not given). A config takes numbers, and a size as a string too: text
    is parsed from a command line, not from Python."""
    if value is None:
        return None
    rule = RULES[option_of(field)]
    if isinstance(value, str) and rule.kind != "size":
        raise UserError(f"{rule.option} must be {rule.allowed()}, got {value!r}")
    return rule(value)


def check_fields(config: object, fields: Iterable[str]) -> None:
    """Check the numeric ``fields`` of a (frozen) dataclass by the table, replacing each
    value by its parsed number (``"2GiB"`` -> bytes)."""
    for name in fields:
        object.__setattr__(config, name, check(name, getattr(config, name)))
