"""Control-plane share and all-reduce cost of the Ray engine at several TP degrees.

    python -m knapspec_dist.tools.overhead --tp 1,2 --new-tokens 64 --repeats 3 --json out.json

For every TP degree: start one replica (a local Ray unless ``--address``), warm it up, then
generate ``--new-tokens`` tokens from the same prompts with each strategy, ``--repeats``
times with the strategy order rotating from repeat to repeat, and report the
time split of the job (runtime/accounting.py): model compute, communication (inside
collectives), Ray calls, other Python, idle -- the control-plane share is Ray + other
Python + idle over wall time. It also microbenchmarks one all-reduce at the decode message
size (batch 1 x hidden x dtype) with ``profiler.measure_allreduce`` and reports the
in-loop cost per sublayer all-reduce (communication time over calls while decoding).

The model: ``--model`` (default: ``smollm2-shape``, a random-weight checkpoint with SmolLM2's
shape -- 30 layers, hidden 576, MLP 1536, vocab 49152, tied embeddings -- but 8 heads of 72
and 2 KV heads, since SmolLM2's 9 heads / 3 KV heads do not divide by 2; it carries SmolLM2's
tokenizer, and is written once under the cache directory). Random weights make KnapSpec
decode autoregressively after its selections; the time split is what is measured here.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from knapspec_dist.cache import cache_dir
from knapspec_dist.model.embedded import resolve_model_path
from knapspec_dist.model.tokenizer import load_tokenizer
from knapspec_dist.model.weights import random_llama_weights
from knapspec_dist.profiles.allreduce import decode_allreduce_sizes
from knapspec_dist.ratio import ratio
from knapspec_dist.runtime.cluster import connect
from knapspec_dist.runtime.ray_engine import RayEngine
from knapspec_dist.tools.corpus import document_of_tokens
from knapspec_dist.tools.interleave import interleaved

log = logging.getLogger(__name__)

SHAPE = dict(vocab=49152, hidden=576, intermediate=1536, layers=30, heads=8, kv_heads=2,
             head_dim=72)


def smollm2_shaped_checkpoint() -> Path:
    """SmolLM2's shape with TP-2-divisible heads, random weights, SmolLM2's tokenizer."""
    root = Path(cache_dir()) / "bench-smollm2-shape"
    if (root / "model.safetensors").is_file():
        return root
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    source = Path(resolve_model_path("smollm2"))
    for f in source.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja",
                                                      "generation_config.json"):
            shutil.copy(f, tmp / f.name)
    s = SHAPE
    config = json.loads((source / "config.json").read_text())
    config.update(num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                  head_dim=s["head_dim"])
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    weights = random_llama_weights(vocab=s["vocab"], hidden=s["hidden"],
                                   intermediate=s["intermediate"], layers=s["layers"],
                                   heads=s["heads"], kv_heads=s["kv_heads"],
                                   head_dim=s["head_dim"])
    save_file(weights, str(tmp / "model.safetensors"))
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


def run(model: str, tps: list[int], strategies: list[str], new_tokens: int, prompt_tokens: int,
        prompts: int, cores: int, address: str | None, profile_contexts: list[int],
        max_num_seqs: int | None = None, repeats: int = 1) -> dict:
    """Every TP degree, one replica each: the time split of each strategy's generation."""
    path = str(smollm2_shaped_checkpoint()) if model == "smollm2-shape" else model
    tokenizer = load_tokenizer(resolve_model_path(path))
    texts = [document_of_tokens(tokenizer, prompt_tokens, start_chapter=k)
             for k in range(prompts)]
    out = {"model": model, "path": path, "new_tokens": new_tokens,
           "prompt_tokens": prompt_tokens, "prompts": prompts, "cores": cores,
           "repeats": repeats, "runs": []}
    connect(address or "local", num_cpus=None if address else max(cores, max(tps)))
    for tp in tps:
        threads = max(1, cores // tp)
        started = time.perf_counter()
        with RayEngine(path, tp=tp, strategy="ar", cpus_per_rank=threads,
                    profile_contexts=profile_contexts, profile_repeats=2,
                    max_num_seqs=max_num_seqs) as engine:
            startup = time.perf_counter() - started
            sizes = decode_allreduce_sizes(engine.config.hidden_size, 1, 1, torch.float32)
            micro = engine.measure_allreduce(sizes)
            for repeat, strategy in interleaved(strategies, repeats):
                job, rates = _strategy_split(engine, strategy, texts, new_tokens)
                run_ = {"tp": tp, "threads_per_rank": threads, "strategy": strategy,
                        "repeat": repeat, "startup_s": startup, **job,
                        "allreduce_micro_us": micro[0][1] * 1e6 if tp > 1 else 0.0,
                        "allreduce_bytes": micro[0][0], **rates}
                out["runs"].append(run_)
                log.info("tp=%d %s: %s", tp, strategy, _line(run_))
    return out


def spreads(runs: list[dict]) -> dict[tuple[int, str], tuple[float, float, float]]:
    """(tp, strategy) -> the control-plane share's median, lowest and highest over repeats."""
    by: dict[tuple[int, str], list[float]] = {}
    for r in runs:
        by.setdefault((r["tp"], r["strategy"]), []).append(r["control_plane_share"])
    return {key: (statistics.median(v), min(v), max(v)) for key, v in by.items()}


def _strategy_split(engine: RayEngine, strategy: str, texts: list[str],
                    new_tokens: int) -> tuple[dict, dict]:
    """One strategy's generation on a warm engine: the job's time split, and its rates."""
    if strategy != engine.options.name:
        engine.reconfigure(strategy)
    engine.generate(texts[:1], max_new_tokens=8)  # warm-up
    results = engine.generate(texts, max_new_tokens=new_tokens, stop_at_eos=False)
    job = dict(engine.last_job)
    calls = job["comm_calls"]
    return job, {
            "comm_per_call_us": job["comm_s"] / calls * 1e6 if calls else 0.0,
            "tokens_per_s": job["new_tokens"] / job["wall_s"],
            "mean_batch": ratio(sum(r.stats.mean_batch or 0.0 for r in results),
                                sum(r.stats.mean_batch is not None for r in results)),
            "selections": sum(r.stats.selections for r in results),
            "acceptance": [r.stats.acceptance_rate for r in results],
            "profile": engine.replica_info(0).profile_key}


def _line(r: dict) -> str:
    return (f"{r['new_tokens']} tokens in {r['wall_s']:.2f}s ({r['tokens_per_s']:.1f} tok/s, "
            f"mean batch {r['mean_batch']:.1f}); "
            f"compute {r['compute_share']:.1%}, comm {r['comm_share']:.1%}, control plane "
            f"{r['control_plane_share']:.1%} (ray {r['ray_s']:.3f}s, other {r['other_s']:.3f}s, "
            f"idle {r['idle_s']:.3f}s); all-reduce {r['comm_per_call_us']:.0f} us/call in the "
            f"loop, {r['allreduce_micro_us']:.0f} us microbenchmark")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m knapspec_dist.tools.overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-shape")
    p.add_argument("--tp", default="1,2")
    p.add_argument("--strategies", default="ar,knapspec")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--cores", type=int, default=2, help="cores shared by the ranks of a replica")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="rows a replica decodes at once (default: the memory rule)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each strategy, the order rotating from repeat to repeat")
    p.add_argument("--profile-contexts", default="64,512")
    p.add_argument("--address", default=None)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = run(args.model, [int(t) for t in args.tp.split(",")], args.strategies.split(","),
              args.new_tokens, args.prompt_tokens, args.prompts, args.cores, args.address,
              [int(n) for n in args.profile_contexts.split(",")], args.max_num_seqs,
              args.repeats)
    for r in out["runs"]:
        log.info("tp=%s %s (repeat %d): %s", r["tp"], r["strategy"], r["repeat"], _line(r))
    for (tp, strategy), (median, low, high) in spreads(out["runs"]).items():
        log.info("tp=%d %s: control plane %.1f %% of wall time (median of %d; %.1f-%.1f %%)",
                 tp, strategy, 100 * median, args.repeats, 100 * low, 100 * high)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
