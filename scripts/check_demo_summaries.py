"""Which sampling settings give ``make demo`` summaries without a repeated sentence: generate
every bundled chapter with the demo's template and row ids as sampling keys (so a row's text
is the demo's: every strategy emits plain sampling's tokens for the same seed), with ``ar`` in
this process, and count each row's repeated sentences (knapspec_dist/tools/repeats.py).

    python scripts/check_demo_summaries.py --setting 0.7,0.9,0,0 --setting 0.5,0.9,0,0

A setting is ``temperature,top_p,top_k,seed``; ``--max-new-tokens`` is the demo's (96).
Prefill is most of the cost (35k prompt tokens), so by default each chapter is prefilled once
and its cache copied to one row per setting, which then decode side by side (plain sampling:
each token ``choose`` of the row's logits with the row's seed and output index, as ``ar``
does). ``--scheduler`` runs the engine's scheduler with ``ar`` per setting instead, the
demo's own path (slow: a prefill per setting), to confirm the shared-prefill texts.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import pyarrow.parquet as pq
import torch

from knapspec_dist.cli.demo import DEMO_INSTRUCTION
from knapspec_dist.engine.generation import GenerationConfig, finish
from knapspec_dist.engine.model_runner import prefill
from knapspec_dist.engine.sampling import choose, row_seed
from knapspec_dist.engine.scheduler import Scheduler, result
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.llm import load
from knapspec_dist.model.cache import KVCache, kv_heads
from knapspec_dist.model.transfer import upload
from knapspec_dist.runtime.prompts import PromptBuilder
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.speculation.options import StrategyOptions
from knapspec_dist.tools.corpus import bundled_sample_path
from knapspec_dist.tools.repeats import repeated_sentences

log = logging.getLogger("check_demo_summaries")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", action="append", required=True,
                   help="temperature,top_p,top_k,seed (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--instruction", default=DEMO_INSTRUCTION)
    p.add_argument("--scheduler", action="store_true",
                   help="the engine's scheduler with ar, a prefill per setting (the demo's path)")
    p.add_argument("--rows", type=int, default=None, help="only the first N chapters")
    p.add_argument("--out", default=None, help="JSON lines of every row's text and repeats")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    loaded = load("smollm2")
    rows = pq.read_table(bundled_sample_path(), columns=["id", "document"]).to_pylist()
    builder = PromptBuilder(loaded.tokenizer, "text", args.instruction,
                            loaded.model.cfg.max_position_embeddings, args.max_new_tokens,
                            False, "document")
    prompts = [(r["id"], builder.build(i, r["id"], r["document"]).ids) for i, r in enumerate(rows)]
    prompts = sorted(prompts, key=lambda p: len(p[1]))[:args.rows]  # shortest first
    configs = []
    for setting in args.setting:
        t, top_p, top_k, seed = setting.split(",")
        configs.append(GenerationConfig.of(max_new_tokens=args.max_new_tokens,
                                           temperature=float(t), top_p=float(top_p),
                                           top_k=int(top_k), seed=int(seed)))
    start = time.perf_counter()
    out = open(args.out, "a") if args.out else None  # noqa: SIM115 -- a line per row as it ends
    counts: dict[str, list[int]] = {s: [] for s in args.setting}
    for row_id, ids in prompts:
        if args.scheduler:
            generated = [scheduler_ids(loaded, [(row_id, ids)], c)[0] for c in configs]
        else:
            generated = shared_prefill_ids(loaded, ids, row_id, configs)
        for setting, out_ids in zip(args.setting, generated):
            text = loaded.tokenizer.decode(out_ids, skip_special_tokens=True)
            reps = repeated_sentences(text)
            counts[setting].append(len(reps))
            if out:
                out.write(json.dumps({"setting": setting, "id": row_id, "ids": out_ids,
                                      "text": text, "repeats": reps}) + "\n")
                out.flush()
        log.info("%s (%d prompt tokens): %s", row_id, len(ids),
                 " ".join(f"{s}:{c[-1]}" for s, c in counts.items()))
    for setting, c in counts.items():
        print(f"{setting}: repeated sentences per row {c}, rows with any "
              f"{sum(n > 0 for n in c)}/{len(c)}, total {sum(c)}", flush=True)
    log.info("%.0f s", time.perf_counter() - start)


def scheduler_ids(loaded, prompts, config) -> list[list[int]]:
    """Every row's text by the engine's scheduler with ``ar``, 4 rows at a time."""
    capacity = max(row_capacity(len(ids), config.max_new_tokens) for _, ids in prompts)
    sched = Scheduler(build_strategy(StrategyOptions("ar"), loaded.model), loaded.model,
                      config, 4, capacity)  # 4 rows: ~2.3 GB of cache
    for rid, (row_id, ids) in enumerate(prompts):
        sched.add(rid, ids, key=row_id)  # the job's key: the row id
    ids: dict[int, list[int]] = {}
    while sched.busy:
        for row in sched.step():
            ids[row.rid] = result(row).token_ids
    return [ids[i] for i in range(len(prompts))]


@torch.inference_mode()
def shared_prefill_ids(loaded, ids: list[int], row_id, configs) -> list[list[int]]:
    """One prompt's new tokens under each setting: prefilled once, its cache copied to one
    row per setting, the rows decoding side by side."""
    model, n = loaded.model, len(configs)
    limit = max(c.max_new_tokens for c in configs)
    cache = KVCache(model.cfg, n, row_capacity(len(ids), limit), dtype=model.dtype,
                    device=model.device, kv_heads=kv_heads(model))
    logits = prefill(model, cache, 0, ids)[None]
    for layer in range(len(cache.k)):
        cache.k[layer][1:] = cache.k[layer][0]
        cache.v[layer][1:] = cache.v[layer][0]
    for b in range(n):
        cache.commit(b, len(ids))
    logits = logits.expand(n, -1)
    seeds = [upload([row_seed(c.sampling.seed, row_id)], model.device) for c in configs]
    outs: list[list[int]] = [[] for _ in configs]
    done = [False] * n
    while True:
        for b, c in enumerate(configs):
            if not done[b]:
                step = upload([len(outs[b])], model.device)
                tok = choose(logits[b:b + 1], c.sampling, seeds[b], step).item()
                outs[b], reason = finish(outs[b] + [tok], c.max_new_tokens, model, c)
                done[b] = reason is not None
        if all(done):
            return outs
        last = [[o[-1]] for o in outs]  # finished rows decode on, unread
        logits = model(upload(last, model.device), cache.lengths, cache, slice(0, n))[:, -1]
        for b in range(n):
            cache.commit(b, cache.lengths[b] + 1)


if __name__ == "__main__":
    main()
