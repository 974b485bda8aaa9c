"""`knapspec bench` end to end on a tiny random checkpoint, and its strategy spec parser."""

from __future__ import annotations

import json

import pytest
import torch

from knapspec_dist.cli import standalone
from knapspec_dist.cli.main import main, parser
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.memory import kv_bytes_per_token_of, slot_size
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.errors import UserError
from knapspec_dist.model.config import load_config
from knapspec_dist.profiles import profiler
from knapspec_dist.speculation.selfspec import SelfSpeculative
from knapspec_dist.tools.bench import compare
from knapspec_dist.tools.bench.compare import bugs
from knapspec_dist.tools.bench.findings import STRATEGIES, findings_markdown, run_findings
from knapspec_dist.tools.bench.prompts import ByteTokenizer, build_prompts
from knapspec_dist.tools.bench.report import PLANS_SHOWN, command_line, summarize, write_markdown
from knapspec_dist.tools.bench.specs import parse_strategies
from knapspec_dist.tools.ties import Divergence, RunCheck, classify

from synthetic import LINEAR_ATTENTION, synthetic_profile

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return checkpoints["llama-gqa"]  # random weights, no tokenizer: prompts are UTF-8 bytes


def bench(checkpoint, out, *extra):
    # tau_conf 0: the random model is rarely confident, and the static drafts must be exercised
    return main(["bench", "--model", str(checkpoint), "--contexts", "64,128",
                 "--strategies", "ar,static:a1@2", "--new-tokens", "8", "--prompts", "2",
                 "--tau-conf", "0", "--out", str(out), *extra])


def test_bench_writes_results_table_and_plots(checkpoint, tmp_path, capsys):
    assert bench(checkpoint, tmp_path) == 0
    assert "error" not in capsys.readouterr().err

    doc = json.loads((tmp_path / "results.json").read_text())
    runs = doc["runs"]
    assert len(runs) == 2 * 2 * 2  # contexts x prompts x strategies
    assert {r["strategy"] for r in runs} == {"ar", "static:a1@2"}
    assert {r["context"] for r in runs} == {64, 128}
    assert len({r["prompt"] for r in runs}) == 2  # two different documents
    assert all(r["matches_ar"] and r["stats"]["new_tokens"] == 8 for r in runs)
    assert all(r["context"] - 3 <= r["prompt_tokens"] <= r["context"] for r in runs)
    static = [r["stats"] for r in runs if r["strategy"] == "static:a1@2"]
    assert sum(s["drafted"] for s in static) > 0
    assert all(s["attention_skipped"] == 1 and s["mlp_skipped"] == 0 for s in static
               if s["drafted"])
    assert doc["mismatches"] == [] and "knapspec bench --model" in doc["command"]

    md = (tmp_path / "results.md").read_text()
    assert "torch" in md and "machine:" in md and "command: `knapspec bench" in md
    for n in (64, 128):
        section = md.split(f"## context {n} ")[1].split("\n## ")[0]
        rows = [line for line in section.splitlines() if line.startswith("| ")
                and not line.startswith("| strategy")]
        assert [row.split("|")[1].strip() for row in rows] == ["ar", "static:a1@2"]
        assert all(row.rstrip().endswith("| yes |") for row in rows)
        assert "| 1.000x |" in rows[0]
        # every token compared (2 prompts x 8), none differs; fp32 on a CPU: no false acceptance
        assert f"| {n} | static:a1@2 | 16 | 0 | 0.00 | 0.00 % |" in md
    assert all(r["check"]["correct"] and r["check"]["tokens"] == 8 for r in runs)
    for name in ("speedup.png", "skipped.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG


def test_bench_repeats_run_each_document_again_in_rotated_order(checkpoint, tmp_path,
                                                               monkeypatch):
    """--repeats 2: every (document, strategy) twice, the strategy order rotating from repeat
    to repeat (so neither strategy always runs first), the rates summed over all runs and the
    per-repeat speedups in results.md."""
    order = []
    generate = compare.generate

    def recording(strategy, model, prompts, config, **kw):
        order.append(getattr(strategy, "name", "?"))
        return generate(strategy, model, prompts, config, **kw)

    monkeypatch.setattr(compare, "generate", recording)
    assert bench(checkpoint, tmp_path, "--repeats", "2", "--no-warmup") == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    runs = doc["runs"]
    assert len(runs) == 2 * 2 * 2 * 2 and doc["repeats"] == 2
    assert sorted({(r["context"], r["prompt"], r["repeat"]) for r in runs}) == sorted(
        {(r["context"], r["prompt"]) + (k,) for r in runs for k in (0, 1)})
    firsts = order[::2]  # the first strategy of each rotation
    assert firsts[:4] == ["ar", "static", "static", "ar"]  # document 0: 0, 1; document 1: 1, 0
    rows = doc["summary"]
    static = [r for r in rows if r["strategy"] != "ar"]
    assert all(r["runs"] == 4 and len(r["repeat_speedups"]) == 2 for r in static)
    md = (tmp_path / "results.md").read_text()
    assert "2 repeats each" in md and "End-to-end speedup per repeat: static:a1@2 " in md


def test_bench_fails_when_a_strategy_differs_from_ar(checkpoint, tmp_path, capsys, monkeypatch):
    """A fault injected from outside: every self-speculative run's last token is changed."""
    original = compare.generate

    def wrong(strategy, model, prompts, config, **kwargs):
        results = original(strategy, model, prompts, config, **kwargs)
        if isinstance(strategy, SelfSpeculative):
            for r in results:
                r.token_ids = r.token_ids[:-1] + [(r.token_ids[-1] + 1) % model.cfg.vocab_size]
        return results

    monkeypatch.setattr(compare, "generate", wrong)
    assert bench(checkpoint, tmp_path, "--no-warmup") == 1
    err = capsys.readouterr().err
    assert "error:" in err and "static:a1@2 differs from ar" in err
    doc = json.loads((tmp_path / "results.json").read_text())
    bad = [r for r in doc["runs"] if not r["matches_ar"]]
    assert {r["strategy"] for r in bad} == {"static:a1@2"} and len(bad) == 4
    assert all(r["first_mismatch"] == 7 for r in bad)
    assert "ERROR" in (tmp_path / "results.md").read_text()


def test_bench_rejects_unknown_strategy(checkpoint, tmp_path, capsys):
    code = main(["bench", "--model", str(checkpoint), "--strategies", "ar,nope",
                 "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "nope" in err and "Traceback" not in err


def test_strategy_specs():
    specs = {s.label: s.options for s in parse_strategies(
        "knapspec,knapspec:coupled,knapspec:alpha,knapspec:once+coupled,clasp@6,"
        "static:a3,m5@4,static:m0+a2")}
    assert list(specs)[0] == "ar"  # the reference is added
    assert specs["knapspec"].name == "knapspec" and not specs["knapspec"].coupled
    assert specs["knapspec:coupled"].coupled
    assert specs["knapspec:alpha"].objective == "alpha"
    once = specs["knapspec:once+coupled"]
    assert once.select_once and once.coupled and once.objective == "tpt"
    assert specs["clasp@6"].name == "clasp" and specs["clasp@6"].gamma == 6
    assert specs["static:a3,m5@4"].skip == "a3,m5" and specs["static:a3,m5@4"].gamma == 4
    assert specs["static:m0,a2"].skip == "m0,a2"
    for bad in ("static", "ar:x", "knapspec:fast", "knapspec@3", "ar,ar", "static:", "foo"):
        with pytest.raises(UserError):
            parse_strategies(bad)


def check_of(*divergences: dict, tokens: int = 16, inside: int = 0) -> dict:
    return RunCheck(tokens, tuple(Divergence(**d) for d in divergences), inside, 0).to_dict()


def test_bench_report_lists_every_divergence_with_its_margin(tmp_path):
    """Every divergence of every run is listed with its gap, tolerance and margin; a run whose
    divergences are all near-ties is reported, not an error; a BUG is an error. The check
    table gives near-ties per 1k tokens and the false-acceptance rate."""
    z = torch.full((8,), -2.0)
    z[3], z[5] = 19.75, 19.625
    tie = classify(z, 12, 3, 5, torch.bfloat16).to_dict()
    later = classify(z, 14, 5, 3, torch.bfloat16).to_dict()
    bug = classify(z, 4, 3, 6, torch.bfloat16).to_dict()
    stats = {"new_tokens": 16, "wall_s": 1.0, "prefill_s": 0.1, "drafted": 8, "accepted": 4,
             "prompt_tokens": 64, "attention_skipped": 1.0, "mlp_skipped": 0.0, "select_s": 0.0,
             "selections": 0, "draft_s": 0.2, "verify_s": 0.5}
    runs = [{"strategy": s, "context": 64, "prompt": p, "matches_ar": not c["divergences"],
             "check": c, "stats": stats}
            for s, p, c in [("ar", "a", check_of(inside=4)), ("ar", "b", check_of()),
                            ("static:a1@2", "a", check_of(tie, later, inside=4)),
                            ("static:a1@2", "b", check_of()), ("clasp", "a", check_of()),
                            ("clasp", "b", check_of(bug))]]
    assert [r["prompt"] for r in bugs(runs)] == ["b"]
    header = {"machine": {"cpu": "x", "torch_threads": 1, "cpu_count": 2}, "command": "c",
              "date": "d", "torch": "t", "model": "m", "dtype": "bf16", "device": "cpu",
              "new_tokens": 16, "prompts": 2}
    rows = summarize(runs)
    assert [(r["ties"], r["bugs"], r["near_ties"]) for r in rows] == [(0, 0, 0), (1, 0, 2),
                                                                      (0, 1, 0)]
    write_markdown(tmp_path / "r.md", header, rows, runs)
    md = (tmp_path / "r.md").read_text()
    assert "ERROR: 1 run(s) differ from `ar` beyond a near-tie" in md
    assert "| near-tie in 1/2 |" in md and "| **NO: 1 BUG** |" in md
    assert ("| 64 | a | static:a1@2 | 1 | 12 | 3 (19.75) | 5 (19.62) | 19.75 | 0.125 | 1.75 | "
            "1.625 | tie |") in md
    assert ("| 64 | a | static:a1@2 | 1 | 14 | 5 (19.62) | 3 (19.75) | 19.75 | 0.125 | 1.75 | "
            "1.625 | tie |") in md
    assert ("| 64 | b | clasp | 1 | 4 | 3 (19.75) | 6 (-2) | 19.75 | 21.75 | 1.75 | -20 | "
            "**BUG** |") in md
    # 2 near-ties in 32 tokens: 62.5 per 1k; 4 of 32 positions inside the bound: 12.5 %
    assert "| 64 | static:a1@2 | 32 | 2 | 62.50 | 12.50 % |" in md
    assert "| 64 | ar | 32 | 0 | 0.00 | 12.50 % |" in md


def test_bench_report_gives_the_top_plans_of_a_strategy_that_priced_them(tmp_path):
    """Per context and strategy that priced its plans: the top plans by seconds, summed over
    the prompts, the rest as other; realized and predicted tok/s. Unpriced plans: no table."""
    def tally(rounds, tokens, seconds, rate):
        return {"rounds": rounds, "tokens": tokens, "seconds": seconds,
                "predicted_tokens": rate * seconds, "priced_s": seconds}

    labels = ["ar"] + [f"a{i},m{i}@4" for i in range(PLANS_SHOWN + 1)]  # one more than shown
    base = {"new_tokens": 16, "wall_s": 1.0, "prefill_s": 0.1, "drafted": 8, "accepted": 4,
            "prompt_tokens": 64, "attention_skipped": 1.0, "mlp_skipped": 1.0, "select_s": 0.0,
            "selections": 1, "draft_s": 0.2, "verify_s": 0.5}
    runs = [{"strategy": "ar", "context": 64, "prompt": p, "matches_ar": True,
             "check": check_of(),
             "stats": {**base, "plans": {"ar": {**tally(15, 15, 0.5, 0.0), "priced_s": 0.0}}}}
            for p in "ab"]
    runs += [{"strategy": "knapspec", "context": 64, "prompt": p, "matches_ar": True,
              "check": check_of(),
              "stats": {**base, "plans": {label: tally(2 + k, 3 + k, 0.1 * (k + 1) + 0.01 * j,
                                                       30 + k)
                                          for k, label in enumerate(labels)}}}
             for j, p in enumerate("ab")]
    header = {"machine": {"cpu": "x", "torch_threads": 1, "cpu_count": 2}, "command": "c",
              "date": "d", "torch": "t", "model": "m", "dtype": "bf16", "device": "cpu",
              "new_tokens": 16, "prompts": 2}
    rows = summarize(runs)
    assert rows[0]["plans"] == []  # ar priced nothing
    write_markdown(tmp_path / "r.md", header, rows, runs)
    section = (tmp_path / "r.md").read_text().split("## plans")[1].split("\n## ")[0]
    table = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines()
             if line.startswith("| 64 |")]
    assert {c[1] for c in table} == {"knapspec"}
    # the plans with the most seconds first, summed over the two prompts; the rest: other
    ranked = list(reversed(labels))
    assert [c[2] for c in table] == ranked[:PLANS_SHOWN] + ["other"]
    for cells, label in zip(table[:PLANS_SHOWN], ranked):
        k = labels.index(label)
        seconds = 2 * 0.1 * (k + 1) + 0.01
        assert cells[3:] == [str(2 * (2 + k)), str(2 * (3 + k)),
                             f"{2 * (3 + k) / seconds:.2f}", f"{30 + k:.2f}"]
    rest = [labels.index(label) for label in ranked[PLANS_SHOWN:]]
    assert table[-1][3:5] == [str(sum(2 * (2 + k) for k in rest)),
                              str(sum(2 * (3 + k) for k in rest))]


@pytest.mark.parametrize("entry", [parser, standalone.parser])
@pytest.mark.parametrize("command", ["bench", "throughput"])
def test_the_recorded_command_names_the_command_that_ran(entry, command):
    """results/throughput files record the command that repeats the run: its own subcommand,
    under the entry point it ran from."""
    args = entry().parse_args([command, "--model", "m", "--out", "o"])
    line = command_line(args, args.func.keywords["parser"])
    prog = "knapspec" if entry is parser else standalone.PROG
    assert line.startswith(f"{prog} {command} ") and "--model m" in line and "--out o" in line


def test_throughput_command_batches_rows_and_checks_them_against_ar(checkpoint, tmp_path, capsys):
    """`knapspec throughput`: mixed-length documents through the scheduler at two batch sizes;
    every row equals batch-1 ar, the batched run decodes more than one row per round."""
    code = main(["throughput", "--model", str(checkpoint), "--contexts", "96", "--documents",
                 "3", "--batch", "1,3", "--strategies", "ar,static:a1,m2@2", "--new-tokens", "6",
                 "--repeats", "2", "--out", str(tmp_path)])
    assert code == 0
    doc = json.loads((tmp_path / "throughput.json").read_text())
    assert doc["command"].startswith("knapspec throughput --model")
    runs = {(r["strategy"], r["batch"]): r for r in doc["runs"]}
    assert set(runs) == {(s, b) for s in ("ar", "static:a1,m2@2") for b in (1, 3)}
    for r in runs.values():
        assert r["identical_rows"] == 3 and r["finished"] == 18 and r["tokens_per_s"] > 0
        assert r["runs"] == 2 and [x["finished"] for x in r["repeats"]] == [18, 18]
        assert r["tokens_per_s"] in [x["tokens_per_s"] for x in r["repeats"]]
    assert runs[("ar", 1)]["mean_batch"] == 1.0 and runs[("ar", 3)]["mean_batch"] > 1.0
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert "| 96 | ar | greedy | 3 | 2 |" in capsys.readouterr().out


def test_sampled_throughput_is_priced_against_greedy_in_the_same_run(checkpoint, tmp_path,
                                                                     capsys):
    """A sampled `knapspec throughput` also runs greedy decoding, interleaved, and reports the
    ratio; each draw's rows are checked against batch-1 ar drawing alike (coupled sampling
    gives ar's tokens)."""
    code = main(["throughput", "--model", str(checkpoint), "--contexts", "96", "--documents",
                 "2", "--batch", "1,2", "--strategies", "ar,static:a1,m2@2", "--new-tokens", "6",
                 "--temperature", "0.9", "--top-p", "0.95", "--out", str(tmp_path)])
    assert code == 0
    doc = json.loads((tmp_path / "throughput.json").read_text())
    runs = {(r["strategy"], r["batch"], r["draw"]): r for r in doc["runs"]}
    assert set(runs) == {(s, b, d) for s in ("ar", "static:a1,m2@2") for b in (1, 2)
                         for d in ("greedy", "sampled")}
    assert all(r["identical_rows"] == 2 and r["finished"] == 12 for r in runs.values())
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 96 | ar | sampled | 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    greedy, sampled = runs[("ar", 2, "greedy")], runs[("ar", 2, "sampled")]
    assert cells[10] == (f"{sampled['tokens_per_s'] / greedy['tokens_per_s']:.3f}x, "
                         f"{sampled['decode_tokens_per_s'] / greedy['decode_tokens_per_s']:.3f}x")
    assert [c.strip() for c in next(line for line in out.splitlines() if line.startswith(
        "| 96 | ar | greedy | 2 |")).strip("|").split("|")][10] == "-"


@pytest.mark.parametrize("method", ["coupled", "rejection"])
def test_a_sampled_bench_says_how_it_sampled(checkpoint, tmp_path, capsys, method):
    """Sampled: results.json and .md name the sampling; coupled runs are checked against ar
    (and match it), rejection runs are marked not compared, and neither is a failure."""
    assert bench(checkpoint, tmp_path, "--temperature", "0.8", "--top-p", "0.9",
                 "--sampling", method) == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["sampling"]["method"] == method and doc["sampling"]["seed"] == 0
    static = [r for r in doc["runs"] if r["strategy"] == "static:a1@2"]
    assert sum(r["stats"]["drafted"] for r in static) > 0
    md = (tmp_path / "results.md").read_text()
    assert f"T 0.8, top-p 0.9, seed 0, {method}" in md and "tokens/round" in md
    if method == "coupled":
        assert all(r["matches_ar"] for r in doc["runs"]) and "not compared" not in md
    else:
        assert all(r["matches_ar"] is None for r in static) and "| not compared |" in md
        assert doc["bugs"] == 0 and doc["mismatches"] == []


def test_findings_preset_writes_the_four_findings(checkpoint, tmp_path, capsys):
    """``--preset findings``: knapspec:paper and its ablations beside ar and knapspec, every
    run token-identical to ar, the findings table and its plot (tiny sizes here)."""
    code = main(["bench", "--model", str(checkpoint), "--preset", "findings", "--contexts",
                 "96", "--new-tokens", "24", "--interval", "8", "--tau-conf", "0",
                 "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "results.json").read_text())
    assert {r["strategy"] for r in doc["runs"]} == set(STRATEGIES.split(","))
    assert all(r["matches_ar"] for r in doc["runs"])
    paper = [r["stats"] for r in doc["runs"] if r["strategy"] == "knapspec:paper"]
    assert sum(s["drafted"] for s in paper) > 0 and doc["prompts"] == 1
    md = (tmp_path / "findings.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| 96 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1].endswith("%") and cells[3].endswith("x") and cells[-1] == "yes"
    assert (tmp_path / "findings.png").read_bytes().startswith(PNG)


def test_run_findings_is_callable_without_the_cli(engine_model):
    """What the gpu-check calls: the findings' strategies on given prompts, priced by the given
    profiles, each run checked against ar, and the table's lines."""

    model = engine_model("llama-gqa")
    profile = synthetic_profile(model, LINEAR_ATTENTION, verify_growth=0.0, verify_scale=100.0)
    prompts = build_prompts(ByteTokenizer(model.cfg.vocab_size), [64], 1,
                            model.cfg.max_position_embeddings, 24, "continue")
    result = run_findings(model, prompts, GenerationConfig.of(max_new_tokens=24,
                                                              stop_at_eos=False),
                          [profile], interval=8)
    assert result["mismatches"] == [] and len(result["findings"]) == 1
    f = result["findings"][0]
    assert f["all_match_ar"] and 0 < f["attention_share"] + f["mlp_share"] <= 1
    lines = findings_markdown(result)
    assert lines[2].startswith("| 64 |") and "knapspec:paper+once" in "\n".join(lines)


def test_throughput_under_a_kv_budget_compares_pages_with_fixed_slots(checkpoint, tmp_path,
                                                                      capsys):
    """`knapspec throughput --kv-cache-memory`: a budget of 2 rows at the model's window; the
    paged run decodes more rows at once, with the fixed run's tokens."""
    config = load_config(checkpoint)
    slot = slot_size(row_capacity(config.max_position_embeddings, 0))  # the engine's rule
    per_token = kv_bytes_per_token_of(config, 1, torch.float32)
    budget = 2 * slot * per_token + 100
    code = main(["throughput", "--model", str(checkpoint), "--kv-cache-memory", str(budget),
                 "--lengths", "20-90", "--documents", "6", "--strategies", "ar,static:a1@2",
                 "--new-tokens", "5", "--page-size", "8", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    runs = {(r["strategy"], r["mode"]): r for r in
            json.loads((tmp_path / "paged.json").read_text())["runs"]}
    for strategy in ("ar", "static:a1@2"):
        fixed, paged = runs[(strategy, "fixed")], runs[(strategy, "paged")]
        assert fixed["max_num_seqs"] == 2 and fixed["mean_batch"] <= 2
        # whole pages of 8 of the same bytes, at most 16 rows of the longest document's
        assert 0 < paged["pool_tokens"] <= budget // per_token and paged["pool_tokens"] % 8 == 0
        # the scratch page is in the budget too
        assert paged["pool_tokens"] > budget // per_token - 16 or paged["pool_tokens"] < 16 * 200
        assert paged["mean_batch"] > 2.5 and paged["identical_rows"] == 6
        assert paged["finished"] == fixed["finished"] == 30
    assert "| ar | paged | 16 |" in capsys.readouterr().out
    assert main(["throughput", "--model", str(checkpoint), "--kv-cache-memory", "1KB",
                 "--out", str(tmp_path)]) != 0
    assert "1000 bytes holds no row of the model's" in capsys.readouterr().err


@pytest.mark.parametrize("busy", [True, False])
def test_throughput_measures_one_profile_per_run_and_keeps_it_when_steady(
        checkpoint, tmp_path, monkeypatch, busy):
    """No stored profile matches: `knapspec throughput` with knapspec at two batch sizes,
    twice each, measures one profile for all four runs. Measured on a busy machine (a load
    average far above the CPUs) it is not cached, so the next command measures once again;
    measured on a quiet one it is kept and the next command measures none."""
    monkeypatch.setenv("KNAPSPEC_PROFILES", str(tmp_path / "repo-profiles"))
    monkeypatch.setenv("KNAPSPEC_PROFILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KNAPSPEC_PROFILE_MAX_SPREAD", "1e9")  # only the load decides here
    real, calls = profiler.measure, []

    def counted(model, *args, **kwargs):
        calls.append(kwargs.get("batch", 1))
        profile = real(model, *args, **{**kwargs, "repeats": 1})
        profile.device.update(kind="cpu", logical_cpus=2, load_average=[9.0 if busy else 0.1])
        return profile

    monkeypatch.setattr(profiler, "measure", counted)
    for run in range(2):
        assert main(["throughput", "--model", str(checkpoint), "--contexts", "64",
                     "--documents", "2", "--batch", "1,2", "--strategies", "ar,knapspec",
                     "--new-tokens", "4", "--repeats", "2",
                     "--out", str(tmp_path / f"out{run}")]) == 0
        assert calls == [1] * (run + 1 if busy else 1), run
    kept = list((tmp_path / "cache").glob("*.json"))
    assert len(kept) == (0 if busy else 1)
