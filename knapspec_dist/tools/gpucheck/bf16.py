"""gpu-check's bf16 section: sampled decoding verified by rejection sampling against the
Gumbel coupling, and the decode / verify logit spread across batch sizes, both in bf16 on the
device (SmolLM2 when installed, else the random tiny model).

**Rejection against coupled.** Per static subnet (smallest skip set first) and prompt, the
same strategy samples (T 0.7, top-p 0.9, seed 0) once with each ``--sampling`` method, in
alternating order on one warmed runner, so neither pays for compiles or captures and a slow
spell of the machine falls on both: acceptance, tokens per full-model round and tokens/s,
then per subnet their ratios, rejection / coupled. Every emitted token is checked against
the top-p support of the full model's one-shot logits before it (``support``): a token
outside is either a rounding accident at the nucleus' edge (its mass above stays near top-p;
the coupled row is the control, it meets the same edges) or a sampler bug (a token deep in
the tail, mass above near 1).

**Spread by batch.** The bf16 spread of 1-token decode steps and 2- and 5-token verifies
against one forward (tools/ties.py ``spread_values``) with B rows decoded together, per batch
size, smallest first: the bound of model/precision.py ``BOUND_ULPS`` must cover twice the
largest. Document 0 is in every batch, so its own worst spread per batch separates what the
batch does from what the other documents bring.
"""

from __future__ import annotations

import time

import torch

from knapspec_dist.engine.generation import GenerationConfig, GenerationStats
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.sampling import METHODS, SamplingConfig, warped, warped_top_k
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.model.precision import rule_ulps
from knapspec_dist.model.tokenizer import encode
from knapspec_dist.speculation.factory import build_strategy
from knapspec_dist.speculation.options import StrategyOptions, format_skip
from knapspec_dist.tools.corpus import row_documents
from knapspec_dist.tools.gpucheck.budget import Section
from knapspec_dist.tools.gpucheck.correct import RealModel, Subject, bf16_subject
from knapspec_dist.tools.gpucheck.rows import Rows
from knapspec_dist.tools.gpucheck.shapes import skip_sets
from knapspec_dist.tools.ties import reference_logits, spread_values, summarize_spread

SAMPLED = dict(temperature=0.7, top_p=0.9, seed=0)  # the bench's sampled setting (sampling.md)


def support(logits: torch.Tensor, tokens: list[int], cfg: SamplingConfig) -> dict:
    """Where ``tokens`` [N] fall against the support of ``cfg`` (top-k, top-p) on ``logits``
    [N, V] (the distribution before each token): how many lie outside it, and the largest
    probability mass above an emitted token (top-k applied, before top-p), which a token
    inside the nucleus keeps below top-p."""
    ids = torch.tensor(tokens, dtype=torch.long)[:, None]
    outside = torch.isinf(warped(logits, cfg).gather(-1, ids))[:, 0]
    p = torch.softmax(warped_top_k(logits.float() / cfg.temperature, cfg), dim=-1)
    mine = p.gather(-1, ids)
    above = torch.where(p > mine, p, torch.zeros_like(p)).sum(-1)
    return {"outside_support": int(outside.sum()),
            "max_mass_above": float(above.max()) if len(tokens) else 0.0}


def run_bf16(device: torch.device, real: RealModel, section: Section, out: dict, rows: Rows, *,
             prompt_tokens: int, new_tokens: int, count: int, skips, spread_tokens: int,
             batches) -> None:
    """Rejection against coupled rows (half the section), then the spread by batch (the
    rest), into ``out`` (the document's "bf16")."""
    subj = bf16_subject(device, real, out["notes"])
    out["model"] = subj.name
    docs = documents(subj, max(count, *batches), prompt_tokens, spread_tokens)
    rejection(subj, [p for p, _ in docs[:count]], new_tokens, skips, out, rows,
              section.part("rejection", 0.5))
    spread_by_batch(subj, docs, batches, out["spread"], rows, section.part("spread", 1.0))


def documents(subj: Subject, count: int, length: int, after: int
              ) -> list[tuple[list[int], list[int]]]:
    """``count`` prompts of ``length`` tokens, each with the ``after`` tokens that follow it
    (corpus documents, no two alike; random tokens without a tokenizer)."""
    if subj.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        vocab = subj.model.cfg.vocab_size
        ids = [torch.randint(2, vocab, (length + after,), generator=g).tolist()
               for _ in range(count)]
    else:
        ids = [encode(subj.tokenizer, text)
               for text in row_documents(subj.tokenizer, count, length + after)]
    return [(x[:length], x[length:length + after]) for x in ids]


def rejection(subj: Subject, prompts: list[list[int]], new_tokens: int, skips, out: dict,
              rows: Rows, section: Section) -> None:
    model = subj.model
    sets = skip_sets(model.cfg.num_layers)
    strategies = {label: build_strategy(StrategyOptions(name="static",
                                                        skip=format_skip(sets[label])), model)
                  for label in sorted(skips, key=lambda k: len(sets[k]))}
    configs = {m: GenerationConfig.of(max_new_tokens=new_tokens, stop_at_eos=False,
                                      sampling=m, **SAMPLED) for m in METHODS}
    runner = ModelRunner(model)  # one cache and set of graphs for every run
    warm = {m: GenerationConfig.of(max_new_tokens=4, stop_at_eos=False, sampling=m, **SAMPLED)
            for m in METHODS}
    if rows.attempt(out["notes"], "warming the runner", lambda: [
            generate(s, model, [prompts[0][:32]], c, runner=runner)
            for s in strategies.values() for c in warm.values()]) is None:
        return
    for label, strategy in strategies.items():
        for j, prompt in enumerate(prompts):
            order = METHODS[j % 2:] + METHODS[:j % 2]
            for method in order:
                def run(strategy=strategy, prompt=prompt, method=method) -> dict:
                    r = generate(strategy, model, [prompt], configs[method], runner=runner)[0]
                    logits = reference_logits(model, prompt, r.token_ids)
                    return {**rates(r.stats),
                            **support(logits, r.token_ids, configs[method].sampling)}
                rows.add(out["rejection"], {"skip_set": label, "skipped": len(sets[label]),
                                            "prompt": j, "method": method, "dtype": "bf16"},
                         run, section)
    out["summary"] = summarize([r for r in out["rejection"] if r["status"] == "ok"])
    rows.save()


def rates(stats: GenerationStats) -> dict:
    """A run's acceptance, tokens per full-model round and tokens/s (with their counts, which
    the summary sums)."""
    return {"new_tokens": stats.new_tokens, "drafted": stats.drafted, "accepted": stats.accepted,
            "rounds": stats.rounds, "wall_s": stats.wall_s, "acceptance": stats.acceptance_rate,
            "tokens_per_round": (stats.new_tokens - 1) / stats.rounds if stats.rounds else None,
            "tokens_per_s": stats.tokens_per_s}


def summarize(runs: list[dict]) -> list[dict]:
    """Per skip set: each method's totals over its prompts, and rejection / coupled."""
    out = []
    for label in dict.fromkeys(r["skip_set"] for r in runs):
        per = {}
        for m in METHODS:
            mine = [r for r in runs if r["skip_set"] == label and r["method"] == m]
            if not mine:
                continue
            total = {k: sum(r[k] for r in mine) for k in ("new_tokens", "drafted", "accepted",
                                                          "rounds", "wall_s")}
            per[m] = {"prompts": len(mine),
                      "acceptance": total["accepted"] / total["drafted"] if total["drafted"]
                      else 0.0,
                      "tokens_per_round": ((total["new_tokens"] - len(mine)) / total["rounds"]
                                           if total["rounds"] else None),
                      "tokens_per_s": (total["new_tokens"] / total["wall_s"] if total["wall_s"]
                                       else 0.0),
                      "outside_support": sum(r["outside_support"] for r in mine)}
        row = {"skip_set": label, **{f"{m}_{k}": v for m, d in per.items() for k, v in d.items()}}
        if len(per) == 2:
            for k in ("acceptance", "tokens_per_round", "tokens_per_s"):
                a, b = per["rejection"][k], per["coupled"][k]
                row[f"{k}_ratio"] = a / b if a is not None and b else None
        out.append(row)
    return out


def spread_by_batch(subj: Subject, docs: list[tuple[list[int], list[int]]], batches,
                    out: list, rows: Rows, section: Section) -> None:
    """One row per batch size, smallest first, each started only while the section has the
    last row's time left (a larger batch compiles and computes at least as much)."""
    model = subj.model
    bound = rule_ulps(model.dtype, model.device)
    need = 0.0
    for b in sorted(batches):
        def run(b=b) -> dict:
            nonlocal need
            start = time.perf_counter()
            got = spread_values(model, [p for p, _ in docs[:b]], [t for _, t in docs[:b]],
                                qs=(2, 5))
            paths = {path: summarize_spread(path, v) for path, v in got.items()}
            worst = max(s.max for s in paths.values())
            need = time.perf_counter() - start
            return {"positions": next(iter(paths.values())).positions,
                    "median": max(s.median for s in paths.values()),
                    "p90": max(s.p90 for s in paths.values()), "max": worst,
                    "max_row0": max(float(v[0].max()) for v in got.values()),
                    "paths": {p: s.to_dict() for p, s in paths.items()},
                    "bound_ulps": bound, "fits": 2 * worst <= bound}
        rows.add(out, {"batch": b, "dtype": "bf16"}, run, section, need)
