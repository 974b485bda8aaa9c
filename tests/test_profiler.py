"""Latency profiler: measurement on a tiny random checkpoint, JSON, CLI, all-reduce on gloo."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from knapspec_dist.cli.main import main
from knapspec_dist.cli.profile import parse_contexts
from knapspec_dist.errors import UserError
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.weights import load_model
from knapspec_dist.parallel import destroy_distributed
from knapspec_dist.profiles import LatencyProfile
from knapspec_dist.profiles.allreduce import measure_allreduce
from knapspec_dist.profiles.profiler import fill_cache, measure

from models import make_checkpoint

pytestmark = pytest.mark.processes  # spawned gloo ranks

CONTEXTS = [16, 64]
MAX_Q = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint("llama-gqa", tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def profile(checkpoint) -> LatencyProfile:
    return measure(load_model(checkpoint), CONTEXTS, batch=1, max_q=MAX_Q, repeats=2)


def test_measure_records_every_context_and_query_length(profile, checkpoint) -> None:
    s = profile.samples
    assert sorted(n for n, _ in s["attention"]) == CONTEXTS
    assert sorted((int(q), int(n)) for q, n, _ in s["verify"]) == sorted(
        (q, n) for q in range(1, MAX_Q + 1) for n in CONTEXTS)
    assert len(s["mlp"]) == len(s["head"]) == len(CONTEXTS)
    times = [t for _, t in s["attention"]] + s["mlp"] + s["head"] + [t for *_, t in s["verify"]]
    assert all(0.0 < t < 5.0 for t in times)
    assert "allreduce" not in s and profile.tp == 1 and profile.allreduce == 0.0
    assert sorted(profile.verify) == list(range(1, MAX_Q + 1))
    assert profile.mlp > 0 and profile.head > 0 and profile.attention_time(64) > 0
    cfg = load_model(checkpoint).cfg
    assert profile.model == cfg.shape() and profile.dtype == "fp32" and profile.batch == 1
    assert profile.torch_version == torch.__version__
    dev = profile.device
    assert dev["kind"] == "cpu" and dev["threads"] == torch.get_num_threads()
    assert dev["cpu_model"] in dev["name"] and f"{dev['threads']} threads" in dev["name"]
    assert len(dev["load_average"]) == 2 and all(x >= 0 for x in dev["load_average"])


def test_profile_json_has_raw_samples_and_loads_back(profile, tmp_path) -> None:
    path = tmp_path / "p.json"
    profile.save(path)
    raw = json.loads(path.read_text())
    assert raw["samples"]["attention"] and raw["samples"]["verify"] and raw["samples"]["mlp"]
    assert raw["device"]["kind"] == "cpu" and raw["model"]["layers"] == 4
    assert LatencyProfile.load(path) == profile


def test_time_is_attributed_to_the_right_sublayer(checkpoint) -> None:
    """Make every attention sublayer sleep 20 ms: only attention (and the whole verify forward)
    may absorb it, not the MLP or the head."""
    model = load_model(checkpoint)
    sleep = 0.02
    for layer in model.layers:
        inner = layer.attention.forward

        def slow(*args, _inner=inner, **kwargs):
            time.sleep(sleep)
            return _inner(*args, **kwargs)

        layer.attention.forward = slow
    p = measure(model, [16], batch=1, max_q=1, repeats=3, warmup=0)
    assert p.samples["attention"][0][1] >= sleep
    assert p.mlp < sleep and p.head < sleep
    assert p.verify_time(1, 16) >= sleep * model.cfg.num_layers


def test_measure_leaves_no_hooks_and_an_untouched_model(checkpoint) -> None:
    model = load_model(checkpoint)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measure(model, [8], batch=2, max_q=2, repeats=1, fill="prefill")
    modules = [model] + [m for layer in model.layers for m in (layer.attention, layer.mlp)]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in modules)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fill_cache_prefill_writes_exactly_the_requested_positions(checkpoint) -> None:
    model = load_model(checkpoint)
    cache = KVCache(model.cfg, 2, 40, dtype=model.dtype, device="cpu")
    with torch.inference_mode():
        fill_cache(model, cache, 30, "prefill", chunk=8, generator=torch.Generator().manual_seed(0))
    assert cache.lengths == [30, 30]
    for k in cache.k:
        assert k[:, :, :30].abs().sum(-1).min() > 0  # every position of every row was written
        assert not k[:, :, 30:].any()


@pytest.mark.parametrize("text", ["16,abc", "0,16", "", " , ", "-5", "1.5"])
def test_parse_contexts_rejects_bad_lists(text) -> None:
    with pytest.raises(UserError, match="--contexts"):
        parse_contexts(text)


def test_parse_contexts_accepts_sorted_unique_and_k_suffix() -> None:
    assert parse_contexts("1024, 256,4k,256") == [256, 1024, 4096]


def test_cli_profile_writes_file_named_by_key(checkpoint, tmp_path, capsys) -> None:
    outdir = tmp_path / "profiles"
    outdir.mkdir()
    rc = main(["profile", "--model", str(checkpoint), "--contexts", "16,32", "--max-q", "2",
               "--repeats", "1", "--out", str(outdir)])
    assert rc == 0
    files = list(outdir.glob("*.json"))
    assert len(files) == 1
    p = LatencyProfile.load(files[0])
    assert files[0].name == f"{p.key()}.json"
    assert sorted(n for n, _ in p.samples["attention"]) == [16, 32] and sorted(p.verify) == [1, 2]
    assert str(files[0]) in capsys.readouterr().out

    named = tmp_path / "sub" / "mine.json"
    assert main(["profile", "--model", str(checkpoint), "--contexts", "8", "--max-q", "1",
                 "--repeats", "1", "--batch", "2", "--out", str(named)]) == 0
    assert LatencyProfile.load(named).batch == 2
    assert main(["profile", "--model", str(checkpoint), "--contexts", "8", "--max-q", "1",
                 "--repeats", "1", "--batch", "3", "--kv", "paged", "--page-size", "4",
                 "--out", str(outdir)]) == 0
    paged = LatencyProfile.load(outdir / f"{p.key().replace('__b1__', '__b3__')}__paged.json")
    assert (paged.batch, paged.kv) == (3, "paged") and "paged KV" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--contexts", "16,lots"], "--contexts"),
    (["--contexts", "100000"], "context length 2048"),
    (["--repeats", "0"], "--repeats"),
    (["--page-size", "0"], "--page-size"),
])
def test_cli_profile_bad_options_are_one_line_errors(checkpoint, tmp_path, capsys, args,
                                                     message) -> None:
    out = tmp_path / "p.json"
    rc = main(["profile", "--model", str(checkpoint), "--out", str(out), *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not out.exists()


# --------------------------------------------------------------------------- 2-rank gloo group


def _gloo_worker(rank: int, world: int, store: str, checkpoint: str, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        rows = measure_allreduce(None, [64, 4096, 65536], repeats=3, iters=5)
        prof = measure(load_model(checkpoint), [8, 16], batch=1, max_q=2, repeats=1,
                       group=dist.group.WORLD)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump({"rows": rows, "profile": prof.to_json()}, f)
    finally:
        destroy_distributed()  # all ranks leave together (see its docstring)


def test_measure_allreduce_on_two_gloo_ranks(checkpoint, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_gloo_worker, args=(2, str(tmp_path / "store"), str(checkpoint), str(tmp_path)),
             nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    rows = results[0]["rows"]
    assert [b for b, _ in rows] == [64.0, 4096.0, 65536.0]
    assert all(0.0 < t < 1.0 for _, t in rows)
    assert results[1]["rows"] == rows  # MAX-reduced: both ranks price the same
    profiles = [LatencyProfile.from_json(r["profile"]) for r in results]
    assert profiles[0].tp == 2 and profiles[0].allreduce > 0.0
    allreduce = profiles[0].samples["allreduce"]
    assert allreduce and all(t > 0 for _, t in allreduce)
    assert profiles[0].samples == profiles[1].samples
