"""What KnapSpec's candidates predict against what they realize, from one prefill per context.

For every context length: prefill one long-document prompt, run one KnapSpec selection (the
DP over the prompt's last m positions), then generate the same new tokens with plain decoding
and with each candidate subnet as a static plan at several draft lengths (rates exclude the
prefill). The table puts the DP's alpha and the profile's predicted
speedup beside the realized acceptance, draft / verify cost and speedup, which is what tells
a miss of the TPT model from a miss of the hardware.

    python scripts/sweep_subnets.py --model smollm2 --contexts 4096,8192 --new-tokens 64
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import prefill
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.engine.sequence import MAX_GAMMA, Batch, Row
from knapspec_dist.llm import load
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.decoder import Capture
from knapspec_dist.profiles.store import resolve_profile
from knapspec_dist.speculation import tpt
from knapspec_dist.speculation.hidden_states import Reference
from knapspec_dist.speculation.knapspec import KnapSpecConfig, KnapSpecSelector
from knapspec_dist.speculation.selfspec import SelfSpeculative, StaticSelector
from knapspec_dist.tools.bench.prompts import build_prompts, resolve_tokenizer

log = logging.getLogger("sweep")


def decode(model, prompt, skip, gamma, config, tau_conf):
    """Stats of one generation with a static plan; ``rate`` excludes the prefill."""
    strategy = SelfSpeculative(StaticSelector(skip, gamma), tau_conf)
    return generate(strategy, model, [prompt], config)[0].stats


def rate(stats) -> float:
    return (stats.new_tokens - 1) / (stats.wall_s - stats.prefill_s)


def sweep(loaded, profile, n: int, args) -> list[str]:
    model = loaded.model
    prompt = build_prompts(loaded.tokenizer, [n], 1, model.cfg.max_position_embeddings,
                           args.new_tokens, "summarize")[n][0].ids
    config = GenerationConfig(max_new_tokens=args.new_tokens, stop_at_eos=False)
    cache = KVCache(model.cfg, 1, len(prompt) + args.new_tokens + MAX_GAMMA + 2,
                    dtype=model.dtype, device=model.device)
    selector = KnapSpecSelector(profile, KnapSpecConfig())
    selector.start(model)
    m = selector.config.m
    capture = Capture(m)  # select on the prompt's last m positions
    with torch.inference_mode():
        prefill(model, cache, 0, prompt, capture=capture)
        reference = Reference(0, len(prompt) - m, torch.stack([h[0] for h in capture]))
        t0 = time.perf_counter()
        selection = selector.select(model, Batch(cache, [Row(0, prompt, args.new_tokens)]),
                                    [reference])
        select_s = time.perf_counter() - t0
    ar = decode(model, prompt, frozenset(), 0, config, args.tau_conf)
    ar_rate = rate(ar)
    verify = lambda q: profile.verify_time(q, len(prompt))  # noqa: E731
    picked = selection.choice.candidate
    chosen = "plain decoding" if picked is None else f"candidate {picked}"
    lines = [f"## context {len(prompt)}", "",
             f"selection {select_s:.2f} s ({select_s * ar_rate:.1f} plain steps), "
             f"{len(selection.candidates)} candidates, weights attn/mlp "
             f"{selection.weights[0]}/{selection.weights[1]}; chose "
             f"{chosen} gamma {selection.choice.gamma}; plain decoding {ar_rate:.2f} tok/s, "
             f"{1e3 / ar_rate:.1f} ms/token (profile {verify(1) * 1e3:.1f} ms)", "",
             "| cand | attn/MLP skipped | DP cosine | DP alpha | gamma | predicted | realized "
             "acceptance | draft ms/token (profile) | verify ms/round | speedup |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    picks = range(0, len(selection.candidates), max(1, args.every))
    for k in sorted(set(picks) | {len(selection.candidates) - 1} - {-1}):
        c, alpha = selection.candidates[k], selection.alphas[k]
        attn = sum(1 for i in c.skipped if i % 2 == 0)
        draft_t = profile.draft_time(c.skipped, len(prompt), model.cfg.num_layers)
        for gamma in args.gammas:
            s = decode(model, prompt, c.skipped, gamma, config, args.tau_conf)
            predicted = tpt.tokens_per_time(alpha, gamma, draft_t, verify) * verify(1)
            lines.append(
                f"| {k} | {attn}/{len(c.skipped) - attn} | {c.value:.3f} | {alpha:.2f} | {gamma} "
                f"| {predicted:.2f}x | {s.acceptance_rate or 0.0:.2f} | "
                f"{1e3 * s.draft_s / max(s.drafted, 1):.1f} ({1e3 * draft_t:.1f}) | "
                f"{1e3 * s.verify_s / max(s.rounds, 1):.1f} | {rate(s) / ar_rate:.2f}x |")
            log.info(lines[-1])
    return lines + [""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--contexts", default="4096,8192")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--gammas", default="1,2,3")
    p.add_argument("--every", type=int, default=4, help="every k-th candidate (and the last)")
    p.add_argument("--tau-conf", type=float, default=0.7)
    p.add_argument("--profile", default=None)
    args = p.parse_args()
    args.gammas = [int(g) for g in args.gammas.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    loaded = load(args.model)
    loaded.tokenizer = resolve_tokenizer(None, Path(loaded.path), loaded.model.cfg.vocab_size)
    profile = resolve_profile(args.profile, loaded.model)
    lines = [f"# sweep_subnets ({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads)", ""]
    for n in (int(x) for x in args.contexts.split(",")):
        lines += sweep(loaded, profile, n, args)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
