"""Every numeric option of every entry point, given bad values from its rule in the one table
(knapspec_dist/option_rules.py): one ``error:`` line naming the option and what it allows,
exit 2, before Ray starts or a model loads, nothing written; the Python APIs (JobConfig for
``run_job``, ProcessorConfig, the generation configs) refuse the same values."""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest

from knapspec_dist.cli.job import main as job_main
from knapspec_dist.cli.main import main as knapspec_main
from knapspec_dist.cli.main import parser as knapspec_parser
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.errors import UserError
from knapspec_dist.jobs import JobConfig, run_job
from knapspec_dist.jobs.options import NUMERIC
from knapspec_dist.option_rules import RULES, Rule, option_of
from knapspec_dist.runtime.processor import ProcessorConfig

from fakes import write_input

#: The commands whose numeric options go through the table, and what else each requires.
COMMANDS = {
    "job": lambda tmp: ["job", "--input", str(tmp / "in.parquet"), "--output", str(tmp / "o")],
    "summarize": lambda tmp: ["--input", str(tmp / "in.parquet"), "--output", str(tmp / "o")],
    "generate": lambda tmp: ["generate", "--prompt", "hello"],
    "bench": lambda tmp: ["bench", "--out", str(tmp / "o")],
    "throughput": lambda tmp: ["throughput", "--out", str(tmp / "o")],
    "demo": lambda tmp: ["demo"],
    "peer": lambda tmp: ["peer", "--out", str(tmp / "o")],
}


def numeric_options(command: str) -> list[Rule]:
    sub = knapspec_parser()._subparsers._group_actions[0].choices
    actions = sub["job" if command == "summarize" else command]._actions
    assert not [a.dest for a in actions if a.type in (int, float)], "a number not in the table"
    return [a.type for a in actions if isinstance(a.type, Rule)]


def bad_values(rule: Rule) -> list[str]:
    """Values the rule refuses: not finite, not a number, huge, empty, out of range, and by
    kind a fraction where an integer is meant or a size without its unit."""
    values = ["nan", "inf", "-inf", "1e400", "", "x"]
    if rule.kind == "int":
        values += ["1.5", "1e3", "2.0"]
    if rule.kind == "size":
        return values + ["0.5", "1e3", "0", "-1GB", "nanGB", "infGB", "1e400GB", "2XB"]
    if rule.low is not None:
        values.append(f"{rule.low:g}" if rule.open_low else
                      str(int(rule.low) - 1) if rule.kind == "int" else f"{rule.low - 0.5:g}")
    if rule.high is not None:
        values.append(str(int(rule.high) + 1) if rule.kind == "int" else f"{rule.high + 0.5:g}")
    return values


CASES = [(command, rule) for command in COMMANDS for rule in numeric_options(command)]


def test_every_entry_point_has_its_numbers_in_the_table():
    options = {c: {r.option for r in numeric_options(c)} for c in COMMANDS}
    assert {"--temperature", "--kv-cache-memory", "--max-num-seqs", "--tp",
            "--row-timeout"} <= options["job"] == options["summarize"]
    assert {"--temperature", "--top-p", "--kv-cache-memory", "--gamma"} <= options["generate"]
    assert {"--new-tokens", "--repeats", "--tau-conf", "--seed"} <= options["bench"]
    assert {"--documents", "--kv-cache-memory", "--page-size"} <= options["throughput"]
    assert {option_of(f) for f in NUMERIC} <= set(RULES)  # and every field of a job


@pytest.mark.parametrize("command,rule", CASES, ids=[f"{c}{r.option}" for c, r in CASES])
def test_a_bad_number_is_one_error_line_before_anything_runs(command, rule, tmp_path, capsys):
    main = job_main if command == "summarize" else knapspec_main
    for value in bad_values(rule):
        rc = main([*COMMANDS[command](tmp_path), rule.option, value])  # -inf is a value
        out, err = capsys.readouterr()
        assert rc == 2, (rule.option, value)
        assert out == "" and err.splitlines() == [
            f"error: {rule.option} must be {rule.allowed()}, got {value!r}"], (value, err)
        assert not (tmp_path / "o").exists()
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()


def test_a_temperature_of_nan_runs_no_job_and_writes_nothing(tmp_path, capsys):
    path = write_input(tmp_path / "in.parquet", ["a"], ["Some text."])
    out = tmp_path / "OUT"
    out.mkdir()  # an empty folder stays empty, a new one is not made
    for argv in (["--input", path, "--output", str(out), "--temperature", "nan"],
                 ["--input", path, "--output", str(tmp_path / "new"), "--temperature", "inf"]):
        assert job_main(argv) == 2
        assert capsys.readouterr().err.startswith("error: --temperature must be a finite number")
    assert list(out.iterdir()) == [] and not (tmp_path / "new").exists()
    assert knapspec_main(["generate", "--prompt", "hi", "--temperature", "nan"]) == 2


def test_sizes_are_whole_bytes_or_a_number_with_a_unit():
    size = RULES["--kv-cache-memory"]
    assert [size(s) for s in ("300000000", "2GiB", "1.5GB", "512 MiB", "1e3GB", "0.5KB")] == [
        300_000_000, 2 ** 31, 1_500_000_000, 2 ** 29, 10 ** 12, 500]
    assert size(2 ** 20) == 2 ** 20 and size(1e9) == 10 ** 9  # a whole number from Python
    for bad in ("0.5", "1e3", "0.0001B", 0, 1.5, True):
        with pytest.raises(UserError, match="--kv-cache-memory must be a size"):
            size(bad)


BAD_NUMBERS = [math.nan, math.inf, -math.inf, float("1e400"), "", "7"]


@pytest.mark.parametrize("field", NUMERIC)
def test_a_jobs_python_config_refuses_what_its_command_line_refuses(field, tmp_path):
    """``run_job`` takes a JobConfig: every numeric field is checked by the table when it is
    made (or replaced), naming the option, before any input is read."""
    rule = RULES[option_of(field)]
    config = JobConfig(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "o"))
    values = [v for v in BAD_NUMBERS if not (rule.kind == "size" and v == "7")]
    values += [1.5] if rule.kind in ("int", "size") else []
    for value in values:
        with pytest.raises(UserError, match=f"^{rule.option} must be "):
            run_job(dataclasses.replace(config, **{field: value}))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field", ["tp", "concurrency", "cpus_per_rank", "max_num_seqs",
                                   "kv_cache_memory", "memory_utilization", "max_model_len",
                                   "max_num_batched_tokens", "batch_size", "max_attempts",
                                   "tokenizer_concurrency", "tokenizer_cpus"])
def test_the_processor_refuses_them_too(field):
    rule = RULES[option_of(field)]
    for value in [math.nan, math.inf, -math.inf, 0 if rule.kind != "float" else -1.0]:
        with pytest.raises(UserError, match=f"^{rule.option} must be "):
            ProcessorConfig(**{field: value})
    with pytest.raises(UserError, match="--concurrency"):
        ProcessorConfig(concurrency=(1, math.inf))


@pytest.mark.parametrize("name,value", [("temperature", math.nan), ("temperature", math.inf),
                                        ("top_p", math.nan), ("top_k", 2.5), ("seed", -1),
                                        ("max_new_tokens", 0)])
def test_sampling_options_are_refused_by_every_python_entry(name, value):
    option = RULES[option_of(name)].option
    with pytest.raises(UserError, match=f"^{option} must be "):
        ProcessorConfig(sampling={name: value})
    if name != "max_new_tokens":  # a generation's own limit is checked per prompt
        with pytest.raises(UserError, match=f"^{option} must be "):
            GenerationConfig.of(**{name: value})
