"""The batch-job layer without Ray: input checks, prompts, checkpoints, resume, scheduling.

A fake tokenizer (one token per word, a 4-token chat template) and a fake engine backend
(replicas that "generate" deterministic tokens and can be told to die) stand in for the
model and for Ray, so each rule is tested exactly and fast.  The real engine, Ray and
``ray job submit`` are in ``test_jobs_e2e.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from knapspec_dist.cli.job import add_job_args, config_from_args, main, register
from knapspec_dist.errors import UserError
from knapspec_dist.jobs import JobConfig, run_job
from knapspec_dist.jobs import summary as summary_mod
from knapspec_dist.jobs.baseline import choose_baseline
from knapspec_dist.jobs.inputs import iter_texts, read_input
from knapspec_dist.jobs.output import OutputDir, PartWriter, output_schema, result_row
from knapspec_dist.jobs.report import report
from knapspec_dist.jobs.summary import summarize, throughput
from knapspec_dist.model.embedded import ensure_smollm2
from knapspec_dist.model.tokenizer import load_tokenizer
from knapspec_dist.runtime.dispatch import Dispatcher, Task
from knapspec_dist.runtime.messages import KVReport
from knapspec_dist.runtime.prompts import Prompt, PromptBuilder
from knapspec_dist.speculation.options import StrategyOptions, parse_strategy

from fakes import (
    BOS,
    FakeBackend,
    FakeEngines,
    FakeTokenizer,
    ReplicaDied,
    docs_of,
    fake_tools,
    job,
    read_rows,
    run,
    write_input,
)

# ----------------------------------------------------------------------------- input: file level


@pytest.fixture
def good_input(tmp_path):
    return write_input(tmp_path / "in.parquet", ["a", "b", "c"], docs_of([5, 9, 3]))


def test_reads_a_file_a_directory_a_glob_and_a_file_uri(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    write_input(d / "p1.parquet", ["a", "b"], ["x", "y"])
    write_input(d / "sub" / "p2.parquet", ["c"], ["z"])
    write_input(d / "_ignored.parquet", ["a"], ["dup id, but hidden"])
    (d / ".crc").write_text("not parquet, hidden")
    def ids(spec):
        return read_input(spec, "id", "document").ids.to_pylist()

    assert ids(str(d / "p1.parquet")) == ["a", "b"]
    assert sorted(ids(str(d))) == ["a", "b", "c"]
    assert sorted(ids(str(d / "**/*.parquet"))) == ["a", "b", "c"]
    assert ids(str(d / "*.parquet")) == ["a", "b"]  # top level
    assert ids(str(d / "s?b" / "p[0-9].parquet")) == ["c"]
    scan = read_input(f"file://{d}/sub/p2.parquet", "id", "document")
    assert [t.column(1).to_pylist() for t in iter_texts(scan, 10)] == [[b"z"]]


BAD_FILES = {
    "missing column": (lambda p: write_input(p, ["a"], ["x"], text_column="body"),
                       "missing column 'document'; it has id, body"),
    "not parquet": (lambda p: (p.write_text("id,document\na,x\n"), str(p))[1],
                    "is not a readable Parquet file"),
    "duplicate ids": (lambda p: write_input(p, ["a", "b", "a"], ["x", "y", "z"]),
                      "1 duplicate 'id' value(s), e.g. 'a'"),
    "no rows": (lambda p: write_input(p, pa.array([], pa.string()), pa.array([], pa.string())),
                "no rows"),
    "null id": (lambda p: write_input(p, ["a", None], ["x", "y"]), "null 'id'"),
    "text not strings": (lambda p: write_input(p, ["a"], [3]), "expected strings"),
    "nothing there": (lambda p: str(p.parent / "missing.parquet"), "no such file"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_malformed_input_fails_fast_before_any_model_loads(tmp_path, case):
    make, message = BAD_FILES[case]
    path = make(tmp_path / "in.parquet")
    touched = []
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_job(job(tmp_path, input=path),
                engine_factory=lambda *a: touched.append("engine"),
                text_tools=lambda c: touched.append("tokenizer"))
    assert touched == []  # neither the tokenizer nor the engine was loaded
    assert not (tmp_path / "out").exists()  # nor the output directory created


def test_main_prints_one_error_line_and_exits_2(tmp_path, capsys):
    path = write_input(tmp_path / "in.parquet", ["a", "a"], ["x", "y"])
    code = main(["--input", path, "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("error: ") and "duplicate 'id'" in err[-1]
    assert not [line for line in err if "Traceback" in line]


def test_files_with_disagreeing_schemas_are_a_file_error(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write_input(d / "p1.parquet", ["a"], ["x"])
    write_input(d / "p2.parquet", [7], ["y"])
    with pytest.raises(UserError, match="schemas disagree"):
        read_input(str(d), "id", "document")


# ----------------------------------------------------------------------------- prompts: row level


def builder(window=20, new=4, truncate=False, mode="text", tok=None):
    return PromptBuilder(tok or FakeTokenizer(), mode, "Sum:", window, new, truncate, "document")


def test_rows_with_null_empty_or_too_long_text_get_an_error():
    b = builder(window=20, new=4)  # prompt limit 16 = 4 template + "Sum:" + 11 words
    assert b.build(0, "a", None).error == "'document' is null"
    assert b.build(1, "b", "  \n").error == "'document' is empty"
    fits = b.build(2, "c", " ".join(["w"] * 11))
    assert fits.error is None and fits.num_input_tokens == 16
    long = b.build(3, "d", " ".join(["w"] * 12))
    assert long.ids is None and long.num_input_tokens == 17
    assert "17 tokens" in long.error and "--truncate" in long.error


def test_truncate_cuts_the_end_of_the_document_to_fit():
    tok = FakeTokenizer()
    b = builder(window=20, new=4, truncate=True, tok=tok)
    p = b.build(0, "a", " ".join(f"w{i}" for i in range(40)))
    assert p.error is None and p.truncated and len(p.ids) == 16
    assert tok.decode(p.ids) == "Sum: " + " ".join(f"w{i}" for i in range(11))
    assert b.build(1, "b", "short doc").truncated is False


def test_truncate_with_the_real_tokenizer_fits_exactly():
    tok = load_tokenizer(ensure_smollm2())
    b = PromptBuilder(tok, "text", "Summarize:", 300, 50, True, "document")
    doc = ("It is a truth universally acknowledged, that a single man in possession of a good "
           "fortune, must be in want of a wife. ") * 30
    p = b.build(0, "a", doc)
    assert p.error is None and p.truncated
    assert 240 <= len(p.ids) <= 250  # as close to the limit as re-tokenization allows
    text = tok.decode(p.ids)
    assert text.count("truth universally") < 30 and "Summarize:" in text
    prompt_mode = PromptBuilder(tok, "prompt", "", 300, 50, True, "prompt")
    q = prompt_mode.build(1, "b", doc)
    assert q.truncated and 240 <= len(q.ids) <= 250
    assert q.ids[:200] == tok(doc)["input_ids"][:200]  # the start is kept


def test_an_instruction_naming_the_document_places_it_there():
    tok = FakeTokenizer()
    after = PromptBuilder(tok, "text", "{document}\n\nSum {it}:", 40, 4, False, "document")
    before = PromptBuilder(tok, "text", "Sum {it}:", 40, 4, False, "document")
    assert tok.decode(after.build(0, "a", "w {x} v").ids) == "w {x} v Sum {it}:"
    assert tok.decode(before.build(0, "a", "w {x} v").ids) == "Sum {it}: w {x} v"


def test_prompt_mode_uses_the_text_as_is():
    tok = FakeTokenizer()
    b = PromptBuilder(tok, "prompt", "", 20, 4, False, "prompt")
    assert b.build(0, "a", "hello world").ids == [BOS] + tok._ids("hello world")


def test_baseline_rows_spread_over_lengths_at_least_one():
    prompts = [Prompt(i, f"r{i}", [0] * n, n) for i, n in enumerate([50, 10, 40, 20, 30])]
    prompts = [(p.id, p.num_input_tokens) for p in prompts]  # the rows with a prompt
    assert choose_baseline(prompts, 0.05) == {"r4"}  # one row: the median length (30)
    assert choose_baseline(prompts, 0.4) == {"r1", "r0"}  # shortest and longest
    assert choose_baseline(prompts, 0.6) == {"r1", "r4", "r0"}
    assert choose_baseline(prompts, 1.0) == {"r0", "r1", "r2", "r3", "r4"}
    assert choose_baseline(prompts, 0.0) == set()


# ------------------------------------------------------------------------- whole job, fake engine


def test_job_writes_one_row_per_input_row_summary_and_plot(tmp_path):
    docs = docs_of([5, 30, 9, 3])
    write_input(tmp_path / "in.parquet", ["a", "b", "c", "d"], docs[:3] + [None])
    result, engines = run(job(tmp_path, baseline_fraction=0.5))
    rows = {r["id"]: r for r in read_rows(result.output)}
    assert set(rows) == {"a", "b", "c", "d"}
    assert rows["d"]["error"] == "'document' is null" and rows["d"]["generated_text"] is None
    for key in "abc":
        r = rows[key]
        assert r["error"] is None and r["strategy"] == "knapspec"
        assert r["num_generated_tokens"] == 6 == len(r["generated_tokens"])
        assert r["num_input_tokens"] == len(docs["abc".index(key)].split()) + 5
        assert r["time_taken_llm"] == pytest.approx(6 / 30)
        assert r["acceptance_rate"] == 0.5 and r["attention_skipped"] == 3.0
        assert r["attempts"] == 1 and r["replica"] == 0 and r["finished_at"] is not None
        assert r["document_path"] == "whole" and r["tree_generations"] is None
    assert rows["d"]["document_path"] is None  # an input error: no prompt
    # longest document first
    assert [len(s[1]) for s in engines.submits if s[3] == 0] == [35, 14, 10]
    # baseline: ceil(0.5 * 3) = 2 rows (shortest and longest) run again with the job's
    # strategy, then with ar
    assert engines.created == [("knapspec", 1), ("knapspec", 1), ("ar", 1)]
    assert [(s[0], len(s[1])) for s in engines.submits if s[3] > 0] == [
        ("knapspec", 35), ("knapspec", 10), ("ar", 35), ("ar", 10)]  # longest first
    base = {r["id"]: r for r in read_rows(result.output, "baseline")}
    assert set(base) == {"a", "b"} and {r["strategy"] for r in base.values()} == {"ar"}
    again = {r["id"]: r for r in read_rows(result.output, "baseline_strategy")}
    assert set(again) == {"a", "b"} and {r["strategy"] for r in again.values()} == {"knapspec"}
    s = json.loads(open(result.summary_path).read())
    assert s["complete"] and s["rows"] == {"input": 4, "written": 4, "ok": 3, "failed": 1,
                                           "pending": 0, "not_in_input": 0, "generations": 3,
                                           "document_paths": {"whole": 3}}
    assert s["errors"] == {"'document' is null": 1}
    assert s["tokens"]["generated"] == 18
    assert s["baseline"]["rows"] == 2 and s["baseline"]["speedup"] == pytest.approx(1.5)
    assert s["baseline"]["identical_tokens"] == 2
    assert s["acceptance"]["acceptance_rate"] == 0.5
    assert [b["bucket"] for b in s["buckets"]] == ["0-512"]
    assert s["job"]["guarantee"] == "token-identical"  # fp32 on a CPU
    assert open(result.plot_path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(result.plot_path) > 10_000


KV = KVReport(paged=True, page_size=16, pages=100, tokens=1600, bytes=101 * 16 * 512,
              max_num_seqs=16, peak_tokens=1200, peak_use=0.75, peak_rows=7, mean_rows=4.5,
              memory_wait_s=2.5, rows_waited=3)


class KVBackend(FakeBackend):
    """Replicas that report their KV cache (runtime/backend.py's ``kv_report``)."""

    reports = 0

    def kv_report(self):
        KVBackend.reports += 1
        return KV


def test_the_kv_cache_and_its_use_are_in_the_progress_summary_and_report(tmp_path, caplog):
    write_input(tmp_path / "in.parquet", ["a", "b", "c"], docs_of([5, 9, 3]))
    caplog.set_level("INFO", logger="knapspec_dist.jobs")
    config = job(tmp_path, baseline_fraction=0)
    result = run_job(config, engine_factory=FakeEngines(), backend_factory=KVBackend,
                     text_tools=fake_tools())
    assert KVBackend.reports > 0
    assert result.summary["kv_cache"] == KV.to_dict()
    saved = json.loads(open(result.summary_path).read())["kv_cache"]
    assert saved["pages"] == 100 and saved["page_size"] == 16 and saved["tokens"] == 1600
    assert saved["peak_use"] == 0.75 and saved["peak_rows"] == 7 and saved["mean_rows"] == 4.5
    assert saved["memory_wait_s"] == 2.5 and saved["bytes"] == 101 * 16 * 512
    lines = [r.getMessage() for r in caplog.records if "rows (" in r.getMessage()]
    assert any("KV cache 1600 tokens (100 pages of 16" in line and "peak 75%" in line
               and "rows in flight 4.5 mean / 7 peak, 2.5s waiting for memory" in line
               for line in lines), lines
    assert ("KV cache: 1600 tokens per rank (100 pages of 16, 0.00 GiB), peak 75%; rows in "
            "flight 4.5 mean, 7 peak; 2.5s waiting for memory") in report(result)
    again = run_job(config, engine_factory=FakeEngines(), backend_factory=FakeBackend,
                    text_tools=fake_tools())  # nothing left: the earlier run's cache stays
    assert again.summary["kv_cache"] == KV.to_dict()


def test_the_prefill_budget_reaches_every_replica_call_and_not_the_fingerprint(tmp_path):
    """``--max-num-batched-tokens`` travels in the GenerationConfig of every row a replica is
    given (baseline passes included); it changes no token, so a resumed job need not agree."""
    write_input(tmp_path / "in.parquet", ["a", "b"], docs_of([5, 9]))
    configs = []

    class Recording(FakeBackend):
        def submit(self, replica, prompt_ids, config, key=None):
            configs.append(config)
            return super().submit(replica, prompt_ids, config, key)

    config = job(tmp_path, max_num_batched_tokens=3, baseline_fraction=0.5)
    result = run_job(config, engine_factory=FakeEngines(), backend_factory=Recording,
                     text_tools=fake_tools(64))
    assert result.summary["rows"]["ok"] == 2
    assert len(configs) == 4 and {c.max_num_batched_tokens for c in configs} == {3}
    assert config.fingerprint() == job(tmp_path).fingerprint()


def test_a_bf16_job_says_its_tokens_are_identical_up_to_near_ties(tmp_path):
    write_input(tmp_path / "in.parquet", ["a"], docs_of([5]))
    result, _ = run(job(tmp_path, dtype="bf16"))
    assert result.summary["job"]["guarantee"] == "identical up to near-ties (bf16 on cpu)"


def test_ar_strategy_has_no_baseline_run(tmp_path):
    write_input(tmp_path / "in.parquet", ["a", "b"], docs_of([4, 5]))
    result, engines = run(job(tmp_path, strategy="ar"))
    assert engines.created == [("ar", 1)]
    assert result.summary["baseline"]["rows"] == 0 and result.summary["baseline"]["speedup"] is None


def test_integer_ids_and_a_custom_id_column_keep_their_type(tmp_path):
    write_input(tmp_path / "in.parquet", [10, 20, 30], docs_of([3, 4, 5]), id_column="row")
    result, _ = run(job(tmp_path, id_column="row", stop_after=2))
    result, _ = run(job(tmp_path, id_column="row"))
    table = pq.read_table(result.rows_path)
    assert table.schema.field("row").type == pa.int64()
    assert sorted(table.column("row").to_pylist()) == [10, 20, 30]


def test_a_job_whose_rows_all_fail_never_starts_an_engine(tmp_path):
    write_input(tmp_path / "in.parquet", ["a", "b"], [None, ""])
    result, engines = run(job(tmp_path))
    assert engines.created == []
    assert result.summary["complete"] and result.summary["rows"]["failed"] == 2
    assert result.summary["baseline"]["speedup"] is None
    assert open(result.plot_path, "rb").read(4) == b"\x89PNG"


def test_rows_spread_over_replicas(tmp_path):
    write_input(tmp_path / "in.parquet", list("abcdef"), docs_of([3, 4, 5, 6, 7, 8]))
    result, engines = run(job(tmp_path, replicas=3, max_inflight=1, baseline_fraction=0))
    assert sorted({s[2] for s in engines.submits}) == [0, 1, 2]
    assert {r["replica"] for r in read_rows(result.output)} == {0, 1, 2}


def test_a_rows_own_error_is_written_and_the_job_goes_on(tmp_path):
    write_input(tmp_path / "in.parquet", ["a", "b", "c"], docs_of([4, 6, 8]))
    engines = FakeEngines(row_error=lambda key: len(key) == 11)  # row b (6 words + 5)
    result, _ = run(job(tmp_path, baseline_fraction=0), engines)
    rows = {r["id"]: r for r in read_rows(result.output)}
    assert rows["b"]["error"] == "UserError: this row is bad"
    assert rows["a"]["error"] is None and rows["c"]["error"] is None
    assert len(engines.submits) == 3 and engines.restarts == []  # no retry of a row error


def test_a_dead_replica_is_restarted_and_its_rows_retried_once_each(tmp_path):
    write_input(tmp_path / "in.parquet", list("abcdef"), docs_of([3, 4, 5, 6, 7, 8]))

    def kill_after_second_answer(answered, backend):
        if answered == 2:
            backend.kill(0)  # replica 0 dies while it holds rows

    engines = FakeEngines(after_answers=kill_after_second_answer)
    result, _ = run(job(tmp_path, replicas=2, max_inflight=2, baseline_fraction=0), engines)
    rows = read_rows(result.output)
    ids = [r["id"] for r in rows]
    assert sorted(ids) == list("abcdef")  # complete, no duplicate
    assert all(r["error"] is None for r in rows)
    assert engines.restarts == [0]  # one restart per death, not one per failed row
    assert result.summary["run"]["replica_restarts"] == 1
    retried = [r for r in rows if r["attempts"] == 2]
    assert retried  # the rows replica 0 held ran again
    assert len(engines.submits) == 6 + len(retried)


def test_a_row_that_keeps_killing_its_replica_fails_after_max_attempts(tmp_path):
    write_input(tmp_path / "in.parquet", ["a", "b", "c"], docs_of([4, 6, 8]))
    engines = FakeEngines(poison=lambda key: len(key) == 11)  # row b kills whoever runs it
    result, _ = run(job(tmp_path, max_attempts=3, baseline_fraction=0, max_inflight=2), engines)
    rows = {r["id"]: r for r in read_rows(result.output)}
    assert "replica failed 3 time(s)" in rows["b"]["error"] and rows["b"]["attempts"] == 3
    assert rows["a"]["error"] is None and rows["c"]["error"] is None
    # c shared the replica with b once, then ran alone (a suspect) and succeeded
    assert rows["c"]["attempts"] == 2 and rows["a"]["attempts"] == 1
    assert len(engines.restarts) == 3


def test_scheduler_gives_up_on_a_replica_that_cannot_restart():
    class Broken(FakeBackend):
        def restart(self, replica):
            raise ReplicaDied("cannot place the replica")

    engines = FakeEngines(poison=lambda key: key == (1,) and not engines.kills)
    engines.strategy, engines.num_replicas = "ar", 2
    backend = Broken(engines)
    sched = Dispatcher(backend, JobConfig(input="x", output="y").generation_config(),
                      max_inflight=1, restart_backoff=0)
    got = []
    sched.run([Task("a", [1]), Task("b", [2]), Task("c", [3])], got.append)
    assert sorted(o.task.key for o in got) == ["a", "b", "c"]
    assert sched.alive == [False, True]  # replica 0 gave up; replica 1 ran the rest
    assert all(o.replica == 1 for o in got if o.error is None)


def test_row_timeout_restarts_a_silent_replica_and_retries(tmp_path):
    class Hung(FakeBackend):
        def wait(self, handles, timeout):
            live = [h for h in handles if self.handles[h]["epoch"] == self.epoch[
                self.handles[h]["replica"]] and not self.hung(h)]
            if not live:
                time.sleep(timeout)
            return live[:1]

        def hung(self, h):
            return self.engine.restarts == [] and tuple(self.handles[h]["ids"]) == (7,)

    engines = FakeEngines()
    engines.strategy, engines.num_replicas = "ar", 1
    sched = Dispatcher(Hung(engines), JobConfig(input="x", output="y").generation_config(),
                      row_timeout=0.2, tick_seconds=0.05)
    got = []
    sched.run([Task("a", [7]), Task("b", [8])], got.append)
    assert sorted(o.task.key for o in got) == ["a", "b"]
    assert all(o.error is None for o in got) and engines.restarts == [0]


# ------------------------------------------------------------------------- checkpoint and resume


def test_stop_then_resume_skips_finished_rows(tmp_path):
    write_input(tmp_path / "in.parquet", list("abcde"), docs_of([3, 9, 5, 7, 4]))
    first, e1 = run(job(tmp_path, stop_after=2, baseline_fraction=0.2))
    assert first.stopped_early and first.generated == 2
    assert not first.summary["complete"] and first.summary["rows"]["pending"] == 3
    assert [c[0] for c in e1.created] == ["knapspec"]  # no baseline on a partial run
    before = {r["id"]: r for r in read_rows(first.output)}
    assert set(before) == {"b", "d"}  # the two longest

    second, e2 = run(job(tmp_path, baseline_fraction=0.2))
    assert not second.stopped_early and second.skipped == 2 and second.generated == 3
    rows = read_rows(second.output)
    assert sorted(r["id"] for r in rows) == list("abcde")
    generated_again = [s for s in e2.submits if s[3] == 0]  # the main pass
    assert sorted(len(s[1]) for s in generated_again) == [8, 9, 10]  # only a, c, e
    after = {r["id"]: r for r in rows}
    for key in ("b", "d"):  # untouched: same finish time, same part
        assert after[key]["finished_at"] == before[key]["finished_at"]
    s = second.summary
    assert s["complete"] and s["run"]["rows_skipped"] == 2 and s["baseline"]["rows"] == 1

    third, e3 = run(job(tmp_path, baseline_fraction=0.2))  # nothing left: no engine at all
    assert e3.created == [] and third.generated == 0 and third.summary["complete"]


def test_a_crash_between_the_baseline_passes_resumes_with_the_missing_pass_only(tmp_path):
    write_input(tmp_path / "in.parquet", list("abcd"), docs_of([3, 9, 5, 7]))

    class Crash(BaseException):
        pass

    def crash(answered, backend):
        if backend.engine.strategy == "ar":  # the strategy's baseline pass is written
            raise Crash()

    with pytest.raises(Crash):
        run(job(tmp_path, baseline_fraction=0.5, checkpoint_rows=1),
            FakeEngines(after_answers=crash))
    assert len(read_rows(str(tmp_path / "out"), "baseline_strategy")) == 2
    result, engines = run(job(tmp_path, baseline_fraction=0.5))
    assert engines.created == [("ar", 1)]  # nothing else to do
    b = result.summary["baseline"]
    assert b["rows"] == 2 and b["speedup"] == pytest.approx(1.5) and b["identical_tokens"] == 2


def test_crash_then_resume_yields_every_row_exactly_once(tmp_path):
    write_input(tmp_path / "in.parquet", list("abcdefgh"), docs_of(range(3, 11)))

    class Crash(BaseException):  # like SIGKILL or KeyboardInterrupt: not a row's error
        pass

    def crash(answered, backend):
        if answered == 4:
            raise Crash()

    with pytest.raises(Crash):
        run(job(tmp_path, baseline_fraction=0), FakeEngines(after_answers=crash))
    written = read_rows(str(tmp_path / "out"))
    assert len(written) == 3  # the rows that finished before the crash were flushed
    # a torn write and an unreadable part, as a crash on a non-atomic filesystem leaves them
    rows_dir = tmp_path / "out" / "rows"
    (rows_dir / ".part-x.parquet.1234.tmp").write_bytes(b"PAR1 half")
    victim = sorted(rows_dir.glob("part-*.parquet"))[0]
    victim_ids = [r["id"] for r in pq.read_table(victim).to_pylist()]
    victim.write_bytes(b"garbage")

    result, engines = run(job(tmp_path, baseline_fraction=0))
    rows = read_rows(result.output)
    assert sorted(r["id"] for r in rows) == list("abcdefgh")
    assert len(engines.submits) == 8 - 3 + len(victim_ids)
    assert not list(rows_dir.glob(".*.tmp"))
    assert list(rows_dir.glob(".corrupt-*"))
    assert result.summary["complete"] and result.summary["rows"]["written"] == 8


SIGTERM_DRIVER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import fakes as t
from knapspec_dist.jobs import JobConfig, JobTerminated, run_job

class Slow(t.FakeBackend):
    def result(self, h):
        time.sleep(0.2)
        return super().result(h)

config = JobConfig(input=sys.argv[2], output=sys.argv[3], instruction="Sum:", max_new_tokens=6,
                   baseline_fraction=0, checkpoint_rows=1000, checkpoint_seconds=1000,
                   progress_seconds=0.05, progress_bar=False)
engines = t.FakeEngines(after_answers=lambda n, b: print(f"answered {n}", flush=True))
try:
    run_job(config, engine_factory=engines, backend_factory=Slow, text_tools=t.fake_tools())
except JobTerminated:
    print("terminated", flush=True)
    sys.exit(143)
"""


@pytest.mark.e2e
def test_sigterm_writes_the_finished_rows_before_exiting(tmp_path):
    inp = write_input(tmp_path / "in.parquet", list("abcdefgh"), docs_of(range(3, 11)))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_DRIVER, os.path.dirname(__file__),
                             inp, str(out)], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # rows are buffered (checkpoint every 1000 rows) ...
        if line.strip() == "answered 3":
            break
    proc.send_signal(signal.SIGTERM)  # ... as `ray job stop` does it
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) == 143 and "terminated" in rest
    written = [r["id"] for r in read_rows(str(out))]
    assert 2 <= len(written) < 8  # the finished rows were written on the way out
    result, engines = run(job(tmp_path))  # and the resumed job does the rest, once each
    rows = read_rows(result.output)
    assert sorted(r["id"] for r in rows) == list("abcdefgh")
    assert len([s for s in engines.submits if s[3] == 0]) == 8 - len(written)  # main pass


def test_resume_refuses_a_different_job_but_allows_other_hardware(tmp_path):
    write_input(tmp_path / "in.parquet", ["a", "b"], docs_of([3, 4]))
    run(job(tmp_path, stop_after=1))
    with pytest.raises(UserError, match=r"different job \(max_new_tokens: 6 -> 7\)"):
        run(job(tmp_path, max_new_tokens=7))
    result, _ = run(job(tmp_path, replicas=2, tp=2))  # where it runs does not matter
    assert result.summary["complete"]


def test_output_dir_of_something_else_is_refused(tmp_path):
    write_input(tmp_path / "in.parquet", ["a"], docs_of([3]))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds files but no job.json: not a knapspec job.s output"):
        run(job(tmp_path))


def test_part_writer_is_atomic_and_refuses_a_second_row_for_an_id(tmp_path):
    out = OutputDir(str(tmp_path / "o"))
    out.prepare({"x": 1})
    schema = output_schema("id", pa.string())
    w = PartWriter(out, "rows", schema, done_ids={"old"}, flush_rows=2, flush_seconds=1e9)
    w.add(result_row("id", "a", "ar", error="e"))
    assert not list((tmp_path / "o").rglob("*.parquet"))  # buffered
    w.add(result_row("id", "b", "ar", error="e"))
    parts = list((tmp_path / "o" / "rows").iterdir())
    assert len(parts) == 1 and parts[0].name.startswith("part-")
    with pytest.raises(RuntimeError, match="finished twice"):
        w.add(result_row("id", "a", "ar", error="e"))
    with pytest.raises(RuntimeError, match="finished twice"):
        w.add(result_row("id", "old", "ar", error="e"))


# ----------------------------------------------------------------------------- summary, options


def test_summary_speedup_and_buckets_from_rows():
    """The speedup compares the baseline pass of the job's strategy with ar's (each pass's
    throughput); the job's own rows only count for token identity. Here the main pass ran
    in a batch (its rows overlap in time: a per-row comparison with ar would say 0.5x)."""
    schema = output_schema("id", pa.string())
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)

    def row(i, n_in, wall, prefill, strategy="knapspec", tokens=10, start=0.0, same=True):
        r = result_row("id", i, strategy)
        r.update(num_input_tokens=n_in, num_generated_tokens=tokens, time_taken_llm=wall,
                 prefill_s=prefill, tokens_per_s=tokens / wall, drafted=10, accepted=5,
                 generated_tokens=[1 if same else 2] * tokens, acceptance_rate=0.5,
                 attention_skipped=2.0, mlp_skipped=1.0, selections=1, replica=0,
                 generation_start=t0 + dt.timedelta(seconds=start),
                 generation_end=t0 + dt.timedelta(seconds=start + wall))
        return r

    # the job: three rows decoded together, 8 s each
    rows = pa.Table.from_pylist([row("a", 300, 8.0, 0.5), row("b", 1500, 8.0, 1.0),
                                 row("c", 3000, 8.0, 1.0, same=False)], schema=schema)
    # the baseline passes, one row after the other
    again = pa.Table.from_pylist([row("a", 300, 1.0, 0.5, start=100),
                                  row("b", 1500, 2.0, 1.0, start=101)], schema=schema)
    base = pa.Table.from_pylist([row("a", 300, 1.5, 0.5, "ar", start=200),
                                 row("b", 1500, 4.0, 1.0, "ar", start=201.5),
                                 row("c", 3000, 4.0, 1.0, "ar", start=205.5)], schema=schema)
    s = summarize(rows, base, "id", ["a", "b", "c", "d"], {}, {}, again=again)
    assert not s["complete"] and s["rows"]["pending"] == 1
    b = s["baseline"]
    assert b["rows"] == 2  # c has no strategy run in the baseline pass
    assert b["speedup"] == pytest.approx((20 / 3.0) / (20 / 5.5))
    assert b["decode_speedup"] == pytest.approx((20 / 1.5) / (20 / 4.0))
    assert b["row_speedup_min"] == pytest.approx(1.5)
    assert b["row_speedup_max"] == pytest.approx(2.0)
    assert b["identical_tokens"] == 2  # of the job's rows a, b, c: c differs from ar
    assert [(k["bucket"], k["rows"], k["baseline"]["rows"]) for k in s["buckets"]] == [
        ("0-512", 1, 1), ("1k-2k", 1, 1), ("2k-4k", 1, 0)]
    assert s["row_tokens_per_s"] == pytest.approx(30 / 24.0)
    # without the strategy's baseline pass there is no speedup, only the token check
    alone = summarize(rows, base, "id", ["a", "b", "c"], {}, {})["baseline"]
    assert alone["speedup"] is None and alone["identical_tokens"] == 2


def test_summary_plans_predicted_and_realized_tokens_per_second():
    """Per plan, summed over the ok rows (written through the output schema): realized
    tokens over the rounds' seconds, predicted tokens over the seconds priced."""
    schema = output_schema("id", pa.string())

    def row(i, plans, error=None):
        r = result_row("id", i, "knapspec", error=error)
        r.update(num_generated_tokens=0, time_taken_llm=1.0, prefill_s=0.0, plans=[
            {"plan": p, "rounds": n, "tokens": t, "seconds": sec, "predicted_tokens": pt,
             "priced_s": ps} for p, n, t, sec, pt, ps in plans])
        return r

    rows = pa.Table.from_pylist([
        row("a", [("ar", 10, 10, 2.0, 12.0, 2.0), ("a3,m5@4", 4, 12, 2.0, 20.0, 2.0)]),
        row("b", [("a3,m5@4", 6, 18, 4.0, 32.0, 4.0)]),
        row("c", [("ar", 50, 50, 1.0, 0.0, 0.0)], error="boom")], schema=schema)
    s = summarize(rows, rows.slice(0, 0), "id", ["a", "b", "c"], {}, {})
    assert s["plans"] == [
        {"plan": "a3,m5@4", "rows": 2, "rounds": 10, "tokens": 30, "tokens_per_s": 5.0,
         "predicted_tokens_per_s": pytest.approx(52 / 6)},
        {"plan": "ar", "rows": 1, "rounds": 10, "tokens": 10, "tokens_per_s": 5.0,
         "predicted_tokens_per_s": 6.0}]
    many = pa.Table.from_pylist([row(str(i), [(f"a{i}@2", 1, 2, 1.0 + i, 0.0, 0.0)])
                                 for i in range(summary_mod.PLANS_SHOWN + 3)], schema=schema)
    plans = summarize(many, many.slice(0, 0), "id", [], {}, {})["plans"]
    assert len(plans) == summary_mod.PLANS_SHOWN + 1 and plans[-1]["plan"] == "other"
    assert plans[-1]["rows"] == 3 and plans[-1]["predicted_tokens_per_s"] is None


def test_summary_throughput_counts_time_some_row_was_generating():
    """Overlapping rows share wall time: throughput is tokens over the union of the rows'
    admission-to-finish intervals (a gap between runs excluded), less prefill per replica."""
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)

    def row(start, end, prefill, batch):
        return {"num_generated_tokens": 10, "prefill_s": prefill, "replica": 0,
                "mean_batch": batch, "generation_start": t0 + dt.timedelta(seconds=start),
                "generation_end": t0 + dt.timedelta(seconds=end)}

    rows = [row(0, 1, 0.5, 1.0), row(0.5, 2.5, 1.0, 2.0), row(3, 7, 1.0, 4.0)]
    t = throughput(rows, max_num_seqs=8)
    assert t["tokens_per_s"] == pytest.approx(30 / 6.5)
    assert t["decode_tokens_per_s"] == pytest.approx(30 / (6.5 - 2.5))
    assert t["mean_batch"] == pytest.approx(7 / 3) and t["max_num_seqs"] == 8


def test_command_line_options_and_registration():
    p = argparse.ArgumentParser()
    add_job_args(p)
    args = p.parse_args(["--input", "/d/in.parquet", "--output", "/d/out", "--strategy", "static",
                         "--skip", "a3", "--temperature", "0.7", "--seed", "3"])
    c = config_from_args(args)
    assert (c.text_column, c.prompt_column, c.baseline_fraction) == ("document", None, 0.05)
    assert c.strategy == StrategyOptions(name="static", skip="a3")
    assert c.generation_config().sampling.seed == 3 and c.fingerprint()["strategy"] == "static"
    assert c.fingerprint()["strategy_options"]["skip"] == "a3"
    assert JobConfig(input="i", output="o", strategy="ar").strategy == StrategyOptions(name="ar")
    paper = JobConfig(input="i", output="o", strategy="knapspec:paper").strategy  # the names
    assert paper == parse_strategy("knapspec:paper").options and paper.paper  # of the CLI too
    args = p.parse_args(["--input", "i", "--output", "o", "--prompt-column", "p"])
    assert config_from_args(args).mode == "prompt"
    with pytest.raises(SystemExit):
        p.parse_args(["--input", "i", "--output", "o", "--prompt-column", "p",
                      "--text-column", "t"])
    with pytest.raises(UserError, match="--baseline-fraction"):
        JobConfig(input="i", output="o", baseline_fraction=2)
    with pytest.raises(UserError, match="temperature"):
        JobConfig(input="i", output="o", temperature=-1)
    with pytest.raises(UserError, match="--max-num-batched-tokens must be an integer >= 1, got 0"):
        JobConfig(input="i", output="o", max_num_batched_tokens=0)
    args = p.parse_args(["--input", "i", "--output", "o", "--max-num-batched-tokens", "512"])
    assert config_from_args(args).generation_config().max_num_batched_tokens == 512
    default = config_from_args(p.parse_args(["--input", "i", "--output", "o"]))
    assert default.generation_config().max_num_batched_tokens is None  # the device's
    top = argparse.ArgumentParser()
    register(top.add_subparsers(dest="command"))
    assert top.parse_args(["job", "--input", "i", "--output", "o"]).command == "job"
