"""The near-tie bound's measurement: how far a bf16 model's 1-token decode steps and q-token
verify blocks stray from a one-shot forward, unevenly over the top tokens, in bf16 ulps of the
top logit (``tools.ties.logit_spread``). The bound per (dtype, device) in
``model/precision.py`` is twice the largest measured.

SmolLM2 in bf16 on this machine; ``--documents`` corpus documents of ``--context`` tokens,
each followed by its next ``--tokens`` real tokens, teacher-forced.

    OMP_NUM_THREADS=1 python scripts/logit_spread.py --context 512 --tokens 64 --documents 2
"""

from __future__ import annotations

import argparse
import logging

import torch

from knapspec_dist.model.embedded import ensure_smollm2
from knapspec_dist.model.tokenizer import encode, load_tokenizer
from knapspec_dist.model.weights import load_model, resolve_dtype
from knapspec_dist.tools.corpus import AUSTEN_BOOKS, document_of_tokens
from knapspec_dist.tools.ties import logit_spread

log = logging.getLogger("logit_spread")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--documents", type=int, default=2)
    ap.add_argument("--qs", default="2,5", help="verify widths")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    path = ensure_smollm2()
    model = load_model(path, dtype=resolve_dtype(args.dtype), device="cpu")
    tok = load_tokenizer(path)
    qs = tuple(int(q) for q in args.qs.split(","))
    log.info("| document | path | positions | median ulps | p90 | max |")
    log.info("|---|---|---:|---:|---:|---:|")
    worst = 0.0
    for j in range(args.documents):
        book = AUSTEN_BOOKS[j % len(AUSTEN_BOOKS)]
        ids = encode(tok, document_of_tokens(tok, args.context + args.tokens, book=book))
        prompt, tokens = ids[:args.context], ids[args.context:args.context + args.tokens]
        for s in logit_spread(model, prompt, tokens, qs):
            worst = max(worst, s.max)
            log.info("| %s | %s | %d | %.2f | %.2f | %.2f |", book, s.path, s.positions,
                     s.median, s.p90, s.max)
    log.info("largest spread: %.2f ulps; twice that: %.2f ulps", worst, 2 * worst)


if __name__ == "__main__":
    main()
