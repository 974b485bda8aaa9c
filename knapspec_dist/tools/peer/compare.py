"""``knapspec peer``'s measurement (the command: cli/peer.py): one Parquet job's prompts
through this engine in this process and through vLLM in its own venv (vllm_side.py), with the
same model folder, prompt token ids, dtype, threads, rows at once, greedy decoding and new
tokens.

Both engines are timed alike, each in one process: the start-up (load, a warm-up, and for
vLLM its compile and KV allocation), a run with one new token per row (prefill: every prompt
in, its first token out), then the full run, driven step by step. Decode is the full run's
window from the step after which every row has its first token to its end, with the tokens
made in it: both engines mix the last prompts' chunks with the first rows' rounds, so only
that window is decoding alone, timed within one run (a full run less a prefill run would
subtract two noisy figures as large as decode itself). Ours runs the scheduler a replica
runs (engine/scheduler.py, paged KV as a job sizes it, priced by the profiles over pages a
replica looks up), so Ray's messages are not in it (tools/overhead.py measures those).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch

from knapspec_dist.engine.generation import (
    GenerationConfig,
    add_plans,
    plan_records,
    ranked_plans,
)
from knapspec_dist.engine.memory import plan_for
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.scheduler import Scheduler
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.errors import UserError
from knapspec_dist.model.precision import resolve_dtype
from knapspec_dist.model.tokenizer import load_tokenizer
from knapspec_dist.model.weights import load_model
from knapspec_dist.ratio import ratio
from knapspec_dist.runtime.prompts import PromptBuilder
from knapspec_dist.speculation.factory import StrategyBuilder
from knapspec_dist.speculation.options import StrategyOptions

log = logging.getLogger(__name__)

VLLM_SIDE = Path(__file__).with_name("vllm_side.py")


@dataclass(frozen=True)
class PeerJob:
    """What both engines run: the prompts as token ids and how to decode them."""

    model: str  # the model folder
    dtype: str
    threads: int
    max_model_len: int
    max_num_seqs: int
    new_tokens: int
    ids: list[str]
    prompts: list[list[int]]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def read_job(path: str, model: str, *, id_column: str, text_column: str, instruction: str,
             dtype: str, threads: int, max_model_len: int, max_num_seqs: int,
             new_tokens: int) -> PeerJob:
    """The job's rows as the batch job tokenizes them (runtime/prompts.py's builder); a row
    that the job would fail is an error here, since both engines must run every row."""
    try:
        table = pq.read_table(path, columns=[id_column, text_column])
    except (OSError, KeyError, ValueError) as e:
        raise UserError(f"{path}: cannot read columns {id_column!r}, {text_column!r} ({e})") \
            from None
    builder = PromptBuilder(load_tokenizer(model), "text", instruction, max_model_len,
                            new_tokens, False, text_column)
    ids, prompts = [], []
    for i, row in enumerate(table.to_pylist()):
        p = builder.build(i, row[id_column], row[text_column])
        if p.error:
            raise UserError(f"{path} row {i} ({id_column} {row[id_column]!r}): {p.error}")
        ids.append(str(row[id_column]))
        prompts.append(p.ids)
    if not prompts:
        raise UserError(f"{path}: no rows")
    return PeerJob(model, dtype, threads, max_model_len, max_num_seqs, new_tokens, ids, prompts)


def run_vllm(job: PeerJob, python: str, timeout_s: float = 3600,
             ngram: tuple[int, int] | None = None) -> dict:
    """vLLM's timings and tokens, from vllm_side.py run by ``python`` (vLLM's venv);
    ``ngram``: (K, N), vLLM's n-gram speculation drafting K tokens from n-grams of up to N."""
    if not Path(python).exists():
        raise UserError(f"no vLLM venv at {python}: build it with `make vllm-venv`, or pass "
                        "--vllm-python")
    with tempfile.TemporaryDirectory() as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({
            "model": job.model, "dtype": job.dtype, "threads": job.threads,
            "max_model_len": job.max_model_len, "max_num_seqs": job.max_num_seqs,
            "new_tokens": job.new_tokens, "prompts": job.prompts, "ngram": ngram}))
        env = vllm_env(job.threads)
        log.info("vLLM%s: %d rows through %s (its start-up compiles the model)",
                 f" with n-gram drafts K={ngram[0]}, N={ngram[1]}" if ngram else "",
                 len(job.prompts), python)
        proc = subprocess.run([python, str(VLLM_SIDE), str(request), str(result)], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join(proc.stderr.splitlines()[-15:])
            raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{tail}")
        return json.loads(result.read_text())


def vllm_env(threads: int, kv_cache_gib: int = 6) -> dict[str, str]:
    """vLLM's environment: its model threads bound to cores ``0..threads-1`` (its default,
    "auto", keeps one core for its scheduler: 1 thread on a 2-core machine), ``kv_cache_gib``
    of KV cache, offline, no usage report; our ``OMP_NUM_THREADS`` left out (vLLM sets its
    own)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_ours(job: PeerJob, strategies: dict[str, StrategyOptions], repeats: int = 1) -> dict:
    """Our timings and tokens: the start-up, one prefill run, ``repeats`` full runs per
    strategy, interleaved (the order rotates), each strategy's the mean of its repeats."""
    torch.set_num_threads(job.threads)
    start = time.perf_counter()
    model = load_model(job.model, dtype=resolve_dtype(job.dtype))
    runner = ModelRunner(model)
    build = StrategyBuilder(model, kv="paged")  # priced over pages, as a job's replica is
    for options in strategies.values():  # profiles resolved in the start-up, as a job's are
        build(options)
    capacity = max(row_capacity(len(p), job.new_tokens) for p in job.prompts)
    kv = plan_for(model, capacity, paged=True, max_num_seqs=job.max_num_seqs)

    def timed(options: StrategyOptions, new_tokens: int, prompts: list[list[int]]) -> dict:
        sched = Scheduler(build(options), model, GenerationConfig(max_new_tokens=new_tokens),
                          min(job.max_num_seqs, kv.max_num_seqs), capacity, runner=runner,
                          paging=kv.paging())
        t0 = time.perf_counter()
        window = decode_window(sched, prompts)
        return {"s": time.perf_counter() - t0, "tokens": window.pop("tokens"), **window,
                "work": sched.work.to_dict()}

    # a warm-up, as vLLM's start-up has: the cache's pages touched, oneDNN's kernels made
    timed(StrategyOptions(name="ar"), 2, [min(job.prompts, key=len)])
    startup = time.perf_counter() - start

    log.info("ours: prefill run (%d rows, %d prompt tokens)", len(job.prompts), job.prompt_tokens)
    prefill = timed(StrategyOptions(name="ar"), 1, job.prompts)
    labels = list(strategies)
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    for r in range(repeats):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            log.info("ours: %s, %d new tokens per row (run %d of %d)", label, job.new_tokens,
                     r + 1, repeats)
            runs[label].append(timed(strategies[label], job.new_tokens, job.prompts))
    return {"startup_s": startup, "prefill_s": prefill["s"], "prefill_work": prefill["work"],
            "runs": {label: mean_run(rs) for label, rs in runs.items()},
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def mean_run(runs: list[dict]) -> dict:
    """One strategy's repeats as one run: the mean seconds and window tokens (so ratios
    between strategies are those of their sums), the first run's tokens and scheduler work,
    each run's seconds, and how many runs gave the first's tokens."""
    first, n = runs[0], len(runs)
    return {"s": sum(r["s"] for r in runs) / n, "tokens": first["tokens"],
            "decode_window_s": sum(r["decode_window_s"] for r in runs) / n,
            "decode_window_tokens": sum(r["decode_window_tokens"] for r in runs) / n,
            "work": first["work"], "plans": first.get("plans"), "runs_s": [r["s"] for r in runs],
            "runs_identical": sum(r["tokens"] == first["tokens"] for r in runs)}


def decode_window(sched: Scheduler, prompts: list[list[int]]) -> dict:
    """``sched.run(prompts)``, seen after every step as vllm_side.py sees vLLM's: the tokens,
    and the seconds and tokens of the decode window (from the step after which every row has
    its first token to the end)."""
    opened = []  # (time, tokens so far) once every row has its first token

    def watch(s: Scheduler) -> None:
        if not opened and not s.waiting and s.batch.prefilling is None:
            opened.append((time.perf_counter(), s.work.emitted))

    results = sched.run(prompts, on_step=watch)
    end = time.perf_counter()
    tokens = [r.token_ids for r in results]
    generated = sum(map(len, tokens))
    start, made = opened[0] if opened else (end, generated)
    plans: dict[str, dict] = {}
    add_plans(plans, (plan_records(r.stats.plans) for r in results))
    return {"tokens": tokens, "decode_window_s": end - start,
            "decode_window_tokens": generated - made, "plans": ranked_plans(plans, 6)}


def phases(startup_s: float, prefill_s: float, full_s: float, tokens: list[list[int]],
           prompt_tokens: int, decode_s: float, decoded: int) -> dict:
    """Seconds and rates of one engine's run: prefill (prompts in, first tokens out), decode
    (the full run's window after every row's first token: ``decoded`` tokens in
    ``decode_s``), end to end."""
    generated = sum(len(t) for t in tokens)
    return {"startup_s": startup_s, "prefill_s": prefill_s, "decode_s": decode_s,
            "decoded": decoded, "end_to_end_s": full_s, "generated": generated,
            "prefill_tokens_per_s": ratio(prompt_tokens, prefill_s),
            "decode_tokens_per_s": ratio(decoded, decode_s),
            "tokens_per_s": ratio(generated, full_s)}


def vllm_phases(job: PeerJob, vllm: dict) -> dict:
    return phases(vllm["startup_s"], vllm["prefill_s"], vllm["full_s"], vllm["tokens"],
                  job.prompt_tokens, vllm["decode_window_s"], vllm["decode_window_tokens"])


def compare(job: PeerJob, ours: dict, vllm: dict, ngram: dict[str, dict] | None = None
            ) -> dict:
    """Per engine and strategy: phases, speed against vLLM (its time over ours: above 1 we are
    faster; for decode, our rate over its, the windows' tokens may differ) and rows
    token-identical to vLLM's. ``ngram``: vLLM's runs with its n-gram drafts ("K:N" ->
    result); ours is also compared with the fastest of them end to end (``vllm_ngram``)."""
    peer = vllm_phases(job, vllm)
    out = {"vllm": peer, "ours": {}}
    best = None
    if ngram:
        runs = {label: {**vllm_phases(job, r), "identical_to_vllm": sum(
            a == b for a, b in zip(r["tokens"], vllm["tokens"]))} for label, r in ngram.items()}
        label = min(runs, key=lambda k: runs[k]["end_to_end_s"])
        best = runs[label]
        out["vllm_ngram"] = {"runs": runs, "best": label}
    for label, run in ours["runs"].items():
        mine = phases(ours["startup_s"], ours["prefill_s"], run["s"], run["tokens"],
                      job.prompt_tokens, run["decode_window_s"], run["decode_window_tokens"])
        mine["speed_vs_vllm"] = {k: ratio(peer[k], mine[k]) for k in
                                 ("startup_s", "prefill_s", "end_to_end_s")}
        mine["speed_vs_vllm"]["decode_s"] = ratio(mine["decode_tokens_per_s"],
                                                  peer["decode_tokens_per_s"])
        mine["identical_to_vllm"] = sum(a == b for a, b in zip(run["tokens"], vllm["tokens"]))
        ar = ours["runs"].get("ar", run)
        mine["identical_to_ar"] = sum(a == b for a, b in zip(run["tokens"], ar["tokens"]))
        mine["speed_vs_ar"] = {"end_to_end_s": ratio(ar["s"], run["s"]), "decode_s": ratio(
            ratio(run["decode_window_tokens"], run["decode_window_s"]),
            ratio(ar["decode_window_tokens"], ar["decode_window_s"]))}
        mine["runs_s"] = run.get("runs_s", [run["s"]])
        mine["runs_identical"] = run.get("runs_identical", 1)
        if best is not None:
            mine["speed_vs_vllm_ngram"] = {
                "end_to_end_s": ratio(best["end_to_end_s"], mine["end_to_end_s"]),
                "decode_s": ratio(mine["decode_tokens_per_s"], best["decode_tokens_per_s"])}
        mine["work"] = run.get("work")  # what the scheduler did: rounds, drafts, selections
        mine["plans"] = run.get("plans")  # per plan (the first run's): rounds, tokens, rates
        out["ours"][label] = mine
    return out


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def table(job: PeerJob, result: dict) -> list[str]:
    """The Markdown table: seconds (rates) per phase, vLLM against each of our strategies."""
    labels = list(result["ours"])
    head = "| phase | vLLM | " + " | ".join(f"ours {x} | {x} speed vs vLLM" for x in labels)
    lines = [head + " |", "|---|---:|" + "---:|---:|" * len(labels)]
    rows = [("start-up", "startup_s", None), ("prefill", "prefill_s", "prefill_tokens_per_s"),
            ("decode", "decode_s", "decode_tokens_per_s"),
            ("end to end", "end_to_end_s", None)]  # its rate would mix both phases
    peer = result["vllm"]
    for name, key, rate in rows:
        def cell(r: dict) -> str:
            return f"{r[key]:.1f} s" + (f" ({r[rate]:.0f} tok/s)" if rate else "")
        line = f"| {name} | {cell(peer)} | "
        line += " | ".join(f"{cell(m)} | {_x(m['speed_vs_vllm'][key])}"
                           for m in result["ours"].values())
        lines.append(line + " |")
    n = len(job.prompts)
    lines.append("| rows token-identical to vLLM | - | " + " | ".join(
        f"{m['identical_to_vllm']}/{n} | -" for m in result["ours"].values()) + " |")
    lines.append("| speed vs our ar: end to end, decode | - | " + " | ".join(
        f"{_x(m['speed_vs_ar']['end_to_end_s'])}, {_x(m['speed_vs_ar']['decode_s'])} | -"
        for m in result["ours"].values()) + " |")
    lines.append("| runs (interleaved), seconds each, same tokens | - | " + " | ".join(
        f"{len(m['runs_s'])}: {', '.join(f'{x:.0f}' for x in m['runs_s'])}; "
        f"{m['runs_identical']}/{len(m['runs_s'])} | -" for m in result["ours"].values()) + " |")
    lines += plan_lines(result["ours"])
    ngram = result.get("vllm_ngram")
    if ngram:
        lines += ["", "vLLM with its n-gram drafts (K tokens from n-grams of up to N), against "
                  "each of ours:", "",
                  "| vLLM K:N | end to end | decode | rows identical to vLLM | "
                  + " | ".join(f"{x} speed: end to end, decode" for x in labels) + " |",
                  "|---|---:|---:|---:|" + "---:|" * len(labels)]
        for label, r in ngram["runs"].items():
            best = " (fastest)" if label == ngram["best"] else ""
            lines.append(f"| {label}{best} | {r['end_to_end_s']:.1f} s | "
                         f"{r['decode_s']:.1f} s ({r['decode_tokens_per_s']:.0f} tok/s) | "
                         f"{r['identical_to_vllm']}/{n} | " + " | ".join(
                             f"{_x(m['speed_vs_vllm_ngram']['end_to_end_s'])}, "
                             f"{_x(m['speed_vs_vllm_ngram']['decode_s'])}" if best else "-"
                             for m in result["ours"].values()) + " |")
    return lines


def plan_lines(ours: dict[str, dict]) -> list[str]:
    """Per strategy, its first run's rounds by plan: rows' rounds, tokens, the tokens per
    second each row made in them and what the selection predicted."""
    rows = [f"| {label} | {p['plan']} | {p['rounds']} | {p['tokens']} | "
            f"{p['tokens_per_s'] or 0:.1f} | "
            + (f"{p['predicted_tokens_per_s']:.1f}" if p["predicted_tokens_per_s"] else "-")
            + " |" for label, m in ours.items() for p in m.get("plans") or ()]
    if not rows:
        return []
    return ["", "Our rounds by plan (each strategy's first run; a row's rounds, its tokens, "
            "per row):", "", "| strategy | plan | rounds | tokens | tokens/s | predicted |",
            "|---|---|---:|---:|---:|---:|"] + rows


def python_of_venv(venv: str) -> str:
    return str(Path(venv) / "bin" / "python") if Path(venv).is_dir() else venv


def default_vllm_python() -> str:
    """``.venv-vllm`` beside this interpreter's venv: the project's, where ``make vllm-venv``
    builds it."""
    return str(Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python")
