"""Our ``ar`` against transformers ``generate`` on SmolLM2: greedy, same prompts, one process.

Both sides load the same converted SmolLM2-135M-Instruct folder in fp32 (transformers with its
default attention implementation) and decode ``--new-tokens`` tokens greedily, EOS disabled on
both sides so every run emits the same number of tokens. Prompts are long documents from the
public-domain corpus (``corpus.document_of_tokens``) of about each ``--contexts`` length.

Runs are interleaved (ours, theirs, ours, theirs, ...) after a short warm-up of each, so drift
of a shared machine hits both alike. For each run two rates are measured:

* end-to-end: new tokens / (prefill + decode) wall seconds;
* decode: (new tokens - 1) / seconds after the first new token (prefill excluded). Ours takes
  the split from its stats; transformers' from a streamer that timestamps the first new token.

The table prints medians over ``--repeats`` and the ratio ours/theirs, and whether the token ids
are equal (they must be: a mismatch is reported and the exit status is 1).

    OMP_NUM_THREADS=2 python scripts/bench_ar_vs_hf.py --contexts 1024,4096 --repeats 3

``--profile-steps N`` additionally runs torch.profiler over N decode steps of each side at the
largest context and prints the hottest operators.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import sys
import time

import torch
import transformers
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from knapspec_dist import llm
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import prefill
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.tokenizer import encode
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.tools.bench.report import machine
from knapspec_dist.tools.corpus import document_of_tokens

log = logging.getLogger("bench_ar_vs_hf")


class FirstTokenClock:
    """A transformers streamer that records when the first new token arrives."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def put(self, value) -> None:  # first call: the prompt; second: the first new token
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_ours(model, prompt: list[int], new_tokens: int) -> dict:
    config = GenerationConfig.of(max_new_tokens=new_tokens, stop_at_eos=False)
    r = generate(Autoregressive(), model, [prompt], config)[0]
    s = r.stats
    return {"ids": r.token_ids, "wall_s": s.wall_s, "decode_s": s.wall_s - s.prefill_s}


def run_theirs(hf, gen_config, prompt: list[int], new_tokens: int) -> dict:
    ids = torch.tensor([prompt])
    clock = FirstTokenClock()
    with torch.inference_mode():
        start = time.perf_counter()
        gen_config.max_new_tokens = new_tokens
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config,
                          streamer=clock)
        end = time.perf_counter()
    return {"ids": out[0, len(prompt):].tolist(), "wall_s": end - start,
            "decode_s": end - clock.first}


def rates(run: dict) -> tuple[float, float]:
    n = len(run["ids"])
    return n / run["wall_s"], (n - 1) / run["decode_s"] if run["decode_s"] > 0 else 0.0


def _table(prof, rows: int) -> str:
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def profile_ours(model, prompt: list[int], steps: int, rows: int = 15) -> str:
    """torch.profiler over ``steps`` decode steps of ours (the prefill runs outside it)."""
    with torch.inference_mode():
        cache = KVCache(model.cfg, 1, len(prompt) + steps + 1, dtype=model.dtype,
                        device=model.device)
        tok = int(prefill(model, cache, 0, prompt).argmax())
        rows_ = slice(0, 1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                logits = model(torch.tensor([[tok]]), cache.lengths[rows_],
                               cache, rows_)
                cache.commit(0, cache.lengths[0] + 1)
                tok = int(logits[0, -1].argmax())
    return _table(prof, rows)


class ProfileAfterFirstToken(FirstTokenClock):
    """A streamer that profiles generate from its first new token to its end (decode only)."""

    def __init__(self):
        super().__init__()
        self.prof = profile(activities=[ProfilerActivity.CPU])

    def put(self, value) -> None:
        super().put(value)
        if self.calls == 2:
            self.prof.start()

    def end(self) -> None:
        self.prof.stop()


def profile_theirs(hf, gen_config, prompt: list[int], steps: int, rows: int = 15) -> str:
    ids = torch.tensor([prompt])
    streamer = ProfileAfterFirstToken()
    with torch.inference_mode():
        gen_config.max_new_tokens = steps + 1
        hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config,
                    streamer=streamer)
    return _table(streamer.prof, rows)


def load_sides():
    """Both sides on the same SmolLM2 folder in fp32, and transformers' greedy config."""
    loaded = llm.load("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    gen_config = hf.generation_config.__class__.from_dict(hf.generation_config.to_dict())
    gen_config.do_sample, gen_config.eos_token_id = False, None  # greedy, no early stop
    gen_config.pad_token_id = loaded.tokenizer.pad_token_id or 0
    log.info("threads %d, transformers attention %s", torch.get_num_threads(),
             hf.config._attn_implementation)
    return loaded, hf, gen_config


def interleaved_runs(ours, hf, gen_config, prompts: dict[int, list[int]], repeats: int,
                     new_tokens: int) -> list[dict]:
    """Ours, theirs, ours, theirs ... per context and repeat, after a short warm-up of each."""
    warm = next(iter(prompts.values()))[:64]
    run_ours(ours, warm, 8)
    run_theirs(hf, gen_config, warm, 8)
    log.info("warmed up")
    runs = []
    for rep in range(repeats):
        for n, prompt in prompts.items():
            for side in ("ours", "theirs"):
                r = (run_ours(ours, prompt, new_tokens) if side == "ours"
                     else run_theirs(hf, gen_config, prompt, new_tokens))
                e2e, dec = rates(r)
                log.info("repeat %d, context %d, %s: %d tokens, %.2f s, %.2f tok/s "
                         "(decode %.2f tok/s)", rep, n, side, len(r["ids"]), r["wall_s"], e2e, dec)
                runs.append({"repeat": rep, "context": n, "prompt_tokens": len(prompt),
                             "side": side, **r})
    return runs


def summarize(runs: list[dict], prompts: dict[int, list[int]]) -> tuple[list[dict], list[str]]:
    """Per context: median rates of each side, their ratios, whether the ids agree."""
    summary, mismatches = [], []
    for n, prompt in prompts.items():
        row = {"context": n, "prompt_tokens": len(prompt)}
        for side in ("ours", "theirs"):
            mine = [r for r in runs if r["context"] == n and r["side"] == side]
            row[f"{side}_tok_s"] = statistics.median(rates(r)[0] for r in mine)
            row[f"{side}_decode_tok_s"] = statistics.median(rates(r)[1] for r in mine)
        row["ratio"] = row["ours_tok_s"] / row["theirs_tok_s"]
        row["decode_ratio"] = row["ours_decode_tok_s"] / row["theirs_decode_tok_s"]
        ids = {tuple(r["ids"]) for r in runs if r["context"] == n}
        row["ids_equal"] = len(ids) == 1
        if not row["ids_equal"]:
            a = next(r["ids"] for r in runs if r["context"] == n and r["side"] == "ours")
            b = next(r["ids"] for r in runs if r["context"] == n and r["side"] == "theirs")
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            row["first_difference"] = first
            mismatches.append(f"context {n}: token ids differ first at new token {first}")
        summary.append(row)
    return summary, mismatches


def print_table(summary: list[dict], new_tokens: int, repeats: int, cpu: str) -> None:
    print(f"\nSmolLM2-135M-Instruct fp32, greedy, {new_tokens} new tokens, median of "
          f"{repeats}; {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {datetime.date.today().isoformat()}")
    print("| context | prompt tokens | ours tok/s | HF tok/s | ratio | ours decode tok/s "
          "| HF decode tok/s | decode ratio | ids equal |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in summary:
        print(f"| {r['context']} | {r['prompt_tokens']} | {r['ours_tok_s']:.2f} | "
              f"{r['theirs_tok_s']:.2f} | {r['ratio']:.2f}x | {r['ours_decode_tok_s']:.2f} | "
              f"{r['theirs_decode_tok_s']:.2f} | {r['decode_ratio']:.2f}x | "
              f"{'yes' if r['ids_equal'] else 'NO'} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,4096", help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--book", default="prideprejudice", help="corpus book for the prompts")
    p.add_argument("--json", metavar="OUT", help="write all runs and the summary as JSON")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="torch.profiler over this many decode steps at the largest context")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]

    loaded, hf, gen_config = load_sides()
    prompts = {}
    for n in contexts:
        doc = document_of_tokens(loaded.tokenizer, n, args.book)
        prompts[n] = encode(loaded.tokenizer, doc)
        log.info("context %d: prompt of %d tokens", n, len(prompts[n]))
    runs = interleaved_runs(loaded.model, hf, gen_config, prompts, args.repeats, args.new_tokens)
    summary, mismatches = summarize(runs, prompts)
    cpu = machine("cpu")["cpu"]
    print_table(summary, args.new_tokens, args.repeats, cpu)

    if args.profile_steps > 0:
        n, k = contexts[-1], args.profile_steps
        print(f"\n--- torch.profiler: ours, context {n}, {k} decode steps ---")
        print(profile_ours(loaded.model, prompts[n], k))
        print(f"\n--- torch.profiler: transformers generate, context {n}, {k} decode steps ---")
        print(profile_theirs(hf, gen_config, prompts[n], k))

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "cpu": cpu, "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "date": datetime.datetime.now().isoformat(),
                       "summary": summary, "runs": runs}, f, indent=1)
    for m in mismatches:
        log.error(m)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
