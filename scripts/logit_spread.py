"""The near-tie bound's measurement: how far a bf16 model's 1-token decode steps and q-token
verify blocks stray from a one-shot forward, unevenly over the top tokens, in bf16 ulps of the
top logit (``tools.ties.logit_spread``). The bound per (dtype, device) in
``model/precision.py`` is twice the largest measured.

SmolLM2 in bf16 on this machine; ``--documents`` corpus documents of ``--context`` tokens,
each followed by its next ``--tokens`` real tokens, teacher-forced. With ``--batch``, per batch
size B the first B documents are decoded and verified together (one row each), and the table
gives the spread over all their positions next to the same documents' spread each alone: a
row's logits also depend on its batch.

    OMP_NUM_THREADS=1 python scripts/logit_spread.py --context 512 --tokens 64 --documents 2
    OMP_NUM_THREADS=1 python scripts/logit_spread.py --context 512 --tokens 64 --batch 1,4,8,16
"""

from __future__ import annotations

import argparse
import logging

import torch

from knapspec_dist.model.embedded import ensure_smollm2
from knapspec_dist.model.tokenizer import encode, load_tokenizer
from knapspec_dist.model.weights import load_model, resolve_dtype
from knapspec_dist.tools.corpus import AUSTEN_BOOKS, row_documents
from knapspec_dist.tools.ties import logit_spread, spread_values, summarize_spread

log = logging.getLogger("logit_spread")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--documents", type=int, default=2)
    ap.add_argument("--qs", default="2,5", help="verify widths")
    ap.add_argument("--batch", default="", help="batch sizes, e.g. 1,4,8,16 (rows decoded "
                    "together; default: each document alone)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    path = ensure_smollm2()
    model = load_model(path, dtype=resolve_dtype(args.dtype), device="cpu")
    tok = load_tokenizer(path)
    qs = tuple(int(q) for q in args.qs.split(","))
    if args.batch:
        worst = by_batch(model, tok, args, qs, [int(b) for b in args.batch.split(",")])
    else:
        worst = by_document(model, tok, args, qs)
    log.info("largest spread: %.2f ulps; twice that: %.2f ulps", worst, 2 * worst)


def documents(tok, args: argparse.Namespace, count: int) -> list[tuple[list[int], list[int]]]:
    """``count`` documents (``row_documents``: no two alike), each as its prompt and the
    tokens after it."""
    n = args.context + args.tokens
    out = []
    for text in row_documents(tok, count, n):
        ids = encode(tok, text)
        out.append((ids[:args.context], ids[args.context:n]))
    return out


def by_document(model, tok, args: argparse.Namespace, qs: tuple[int, ...]) -> float:
    log.info("| document | path | positions | median ulps | p90 | max |")
    log.info("|---|---|---:|---:|---:|---:|")
    worst = 0.0
    for j, (prompt, tokens) in enumerate(documents(tok, args, args.documents)):
        for s in logit_spread(model, prompt, tokens, qs):
            worst = max(worst, s.max)
            log.info("| %s | %s | %d | %.2f | %.2f | %.2f |", AUSTEN_BOOKS[j % len(AUSTEN_BOOKS)],
                     s.path, s.positions, s.median, s.p90, s.max)
    return worst


def by_batch(model, tok, args: argparse.Namespace, qs: tuple[int, ...],
             batches: list[int]) -> float:
    """Per batch size B and path: the spread of the first B documents decoded together, and
    of the same documents each decoded alone (what the batch adds)."""
    docs = documents(tok, args, max(batches))
    alone = [spread_values(model, [p], [t], qs) for p, t in docs]
    log.info("| batch | path | positions | median ulps | p90 | max | max, each row alone | "
             "rows whose max grew |")
    log.info("|---:|---|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for b in batches:
        rows = docs[:b]
        together = spread_values(model, [p for p, _ in rows], [t for _, t in rows], qs)
        for path, values in together.items():
            s = summarize_spread(path, values)
            single = torch.cat([a[path] for a in alone[:b]])
            grew = int((values.amax(dim=1) > single.amax(dim=1)).sum())
            worst = max(worst, s.max)
            log.info("| %d | %s | %d | %.2f | %.2f | %.2f | %.2f | %d of %d |", b, path,
                     s.positions, s.median, s.p90, s.max, float(single.max()), grew, b)
    return worst


if __name__ == "__main__":
    main()
