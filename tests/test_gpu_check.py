"""``knapspec gpu-check``: the byte arithmetic of the memory bound, the time budget, the
command end to end on a CPU (``--quick``, tiny shapes) and, marked ``gpu``, in full on CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from knapspec_dist.cli.main import main
from knapspec_dist.tools.gpucheck import measure as M
from knapspec_dist.tools.gpucheck import shapes as S
from knapspec_dist.tools.gpucheck.budget import Budget

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SECTIONS = ("decode", "verify", "draft", "backends", "captures", "correctness", "bench", "batched")


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
    assert shapes.over() is None and shapes.seconds == pytest.approx(45)
    now[0] = 20.0  # shapes finished early: the rest share the 80 s left
    correctness = budget.section("correctness")
    assert correctness.seconds == pytest.approx(80 * 0.17 / 0.55)
    half = correctness.part("x", 0.5)
    assert half.seconds == pytest.approx(correctness.seconds / 2)
    now[0] = 90.0
    assert "budget" in correctness.over()


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
    assert draft and all(r["ms"] > 0 and r["pieces_ms"] > 0 and 0 < r["bytes_ratio"] < 1
                         and r["time_ratio"] > 0
                         and r["capture_ms"] >= 0 for r in draft)
    assert any(r["status"] == "ok" and r["ms"] > 0 for r in doc["backends"])
    assert doc["captures"] and all(r["draft_captures"] >= 1 and r["ms_per_capture"] >= 0
                                   for r in doc["captures"])
    greedy = doc["correctness"]["greedy"]
    assert {r["strategy"] for r in greedy} == {"ar", "static", "knapspec", "clasp"}
    assert all(r["verdict"] != "BUG" for r in greedy)
    assert doc["correctness"]["sampling"]
    assert all(r["in_vocab"] and r["new_tokens"] > 0 for r in doc["correctness"]["sampling"])
    assert doc["bench"]["summary"]
    batched = doc["batched"]["runs"]
    assert batched and all(r["status"] == "ok" and r["verdict"] == "ok" for r in batched)
    assert all(r["ar"]["tokens_per_s"] > 0 and r["knapspec"]["tokens_per_s"] > 0
               and r["ar"]["mean_batch"] > 1 for r in batched)


def test_quick_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "gc"
    # A budget no busy machine exhausts: the test checks the program, not the time it takes
    # (about 10 s on an idle 2-core CPU, measured by the command itself in meta.wall_s).
    assert main(["gpu-check", "--device", "cpu", "--quick", "--budget", "600",
                 "--out", str(out)]) == 0
    assert (out / "gpu-check.md").is_file()
    doc = json.loads((out / "gpu-check.json").read_text())
    _check_doc(doc)
    fp32 = [r for r in doc["correctness"]["greedy"] if r["dtype"] == "fp32"]
    assert len(fp32) == 4 and all(r["verdict"] == "identical" for r in fp32)  # CPU fp32: exact
    assert all(r["repeats"] for r in doc["correctness"]["sampling"])
    printed = capsys.readouterr().out
    assert "## Decode step vs memory bound" in printed and "| tiny-gqa |" in printed


def test_rows_that_do_not_fit_say_so():
    cfg = S.tiny(2)
    resident = S.resident_bytes(cfg, 2)
    small = S.memory_need(cfg, 1, 256, 2, 4) - resident
    plan = M.Plan((64, 256), (1, 4), (2, 4), (), 2, S.H200_BANDWIDTH,
                  memory_limit=max(resident, small) + 1)
    with torch.inference_mode():
        out = M.run_shapes({"tiny": cfg}, torch.device("cpu"), torch.bfloat16, plan,
                           Budget(60).section("shapes"))
    status = {(r["context"], r["batch"]): r["status"] for r in out["decode"]}
    assert status[(64, 1)] == "ok"
    assert status[(256, 4)].startswith("does not fit")


@pytest.mark.gpu
@CUDA
def test_full_run_on_cuda(tmp_path):
    out = tmp_path / "gc"
    assert main(["gpu-check", "--device", "cuda", "--out", str(out)]) == 0
    doc = json.loads((out / "gpu-check.json").read_text())
    _check_doc(doc)
    assert doc["meta"]["wall_s"] < 360
    assert {r["model"] for r in doc["decode"]} == {"llama31-8b", "llama31-70b-tp8"}
