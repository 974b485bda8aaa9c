"""What fp32 logits cost: a bf16 model's decode step and verify forward with the head summing
into fp32 (model/head.py ``head_logits``) against a head that returns bf16 logits.

The bf16-output head is ``F.linear(x, weight).float()``: what the model computed before its
logits were fp32. Both heads run on the same cache at the same position after a corpus prompt
of ``--context`` tokens, interleaved (fp32, bf16, fp32, ...) ``--repeats`` times, one thread
by default; the table prints medians and the ratio fp32 / bf16, per forward and per head.

    OMP_NUM_THREADS=1 python scripts/head_cost.py --context 1024 --tokens 1,5,11 --repeats 15
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import torch.nn.functional as F

from knapspec_dist.engine.model_runner import prefill
from knapspec_dist.model.cache import KVCache
from knapspec_dist.model.embedded import ensure_smollm2
from knapspec_dist.model.tokenizer import encode, load_tokenizer
from knapspec_dist.model.weights import load_model
from knapspec_dist.tools.corpus import document_of_tokens

log = logging.getLogger("head_cost")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", default="1,5,11", help="forward widths (1: a decode step)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    path = ensure_smollm2()
    model = load_model(path, dtype=torch.bfloat16, device="cpu")
    tok = load_tokenizer(path)
    ids = encode(tok, document_of_tokens(tok, args.context))[:args.context]
    widths = [int(t) for t in args.tokens.split(",")]
    cache = KVCache(model.cfg, 1, len(ids) + max(widths) + 1, dtype=model.dtype,
                    device=model.device)
    prefill(model, cache, 0, ids)
    weight = model.lm_head.weight
    heads = {"fp32": None, "bf16": lambda x: F.linear(x, weight).float()}
    log.info("| width | head | forward ms (median) | head ms (median) |")
    log.info("|---:|---|---:|---:|")
    ratios = []
    for t in widths:
        tokens = torch.tensor([ids[-t:]])
        x = model.norm(torch.randn(1, t, model.cfg.hidden_size).to(model.dtype))
        times = {k: ([], []) for k in heads}
        with torch.inference_mode():
            for rep in range(args.repeats + 1):
                for name, head in heads.items():
                    if head is None:
                        model.lm_head.__dict__.pop("forward", None)
                    else:
                        model.lm_head.forward = head
                    fwd = timed(lambda: model(tokens, [len(ids)], cache))
                    only = timed(lambda: model.lm_head(x))
                    if rep:  # the first round warms both up
                        times[name][0].append(fwd)
                        times[name][1].append(only)
        model.lm_head.__dict__.pop("forward", None)
        med = {k: (statistics.median(f) * 1e3, statistics.median(h) * 1e3)
               for k, (f, h) in times.items()}
        for k, (f, h) in med.items():
            log.info("| %d | %s | %.2f | %.2f |", t, k, f, h)
        ratios.append((t, med["fp32"][0] / med["bf16"][0], med["fp32"][1] / med["bf16"][1]))
    for t, f, h in ratios:
        log.info("width %d: fp32 / bf16 logits = %.3fx per forward, %.3fx per head", t, f, h)


if __name__ == "__main__":
    main()
