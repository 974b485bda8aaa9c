"""``knapspec bench``'s measurement: every strategy on every prompt, each run checked
against ``ar``'s tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.engine.strategy import Strategy
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.model.precision import rule_ulps
from knapspec_dist.tools.bench.prompts import Prompt
from knapspec_dist.tools.ties import RunCheck, check_run, first_difference, reference_logits

log = logging.getLogger(__name__)


def compare_strategies(model: Transformer, strategies: dict[str, Strategy],
                       prompts: dict[int, list[Prompt]], config: GenerationConfig,
                       save: Callable[[list[dict]], None] = lambda runs: None,
                       runner: ModelRunner | None = None, repeats: int = 1
                       ) -> tuple[list[dict], list[str]]:
    """Every strategy on every prompt, ``repeats`` times; returns the runs and the mismatch
    messages.

    The order of the strategies rotates from prompt to prompt and from repeat to repeat, so a
    drifting machine favours none (a prompt's repeats run back to back, interleaved). Each run
    is compared with ``ar`` at every token (:func:`knapspec_dist.tools.ties.check_run`: after a
    near-tie the strategy is run again from ar's token, untimed), against the full model's
    logits of ar's tokens, computed once per prompt where needed (a divergence, or a near-tie
    rule whose false acceptance is measured: not fp32 on a CPU). ``check`` in the run's record
    holds every divergence with its gap and tolerance, ``divergence`` its first; a message per
    divergence says near-tie or BUG. ``save`` gets the runs so far after each context.
    """
    labels = list(strategies)
    runs, mismatches = [], []

    def rerun(label: str) -> Callable[[list[int], int], list[int]]:
        return lambda ids, k: generate(strategies[label], model, [ids],
                                       replace(config, max_new_tokens=k),
                                       runner=runner)[0].token_ids

    for n, group in prompts.items():
        for j, prompt in enumerate(group):
            logits_of: tuple[list[int], object] | None = None  # ar's tokens, their logits
            for rep in range(repeats):
                k = (j + rep) % len(labels)
                results = {label: generate(strategies[label], model, [prompt.ids], config,
                                           runner=runner)[0]
                           for label in labels[k:] + labels[:k]}
                for label, r in results.items():
                    s = r.stats
                    log.info("context %d, %s, %s (repeat %d): %d tokens, %s tok/s (decode "
                             "%.2f s), acceptance %s", n, prompt.id, label, rep + 1,
                             s.new_tokens, s.tokens_per_s, s.wall_s - s.prefill_s,
                             s.acceptance_rate)
                reference = results["ar"].token_ids
                compared = [label for label in labels
                            if label == "ar" or config.sampling.identical_to_plain]
                needed = rule_ulps(model.dtype, model.device) > 0 or any(
                    results[label].token_ids != reference for label in compared)
                if needed and (logits_of is None or logits_of[0] != reference):
                    logits_of = (reference, reference_logits(model, prompt.ids, reference))
                for label in labels:
                    if label not in compared:
                        runs.append(_uncompared(n, prompt, label, rep, results[label],
                                                reference))
                        continue
                    check = check_run(model, prompt.ids, reference, results[label].token_ids,
                                      rerun(label), logits_of[1] if needed else None)
                    runs.append(_record(n, prompt, label, rep, results[label], check,
                                        mismatches))
        save(runs)
    return runs, mismatches


def _record(n: int, prompt: Prompt, label: str, rep: int, r, check: RunCheck,
            mismatches: list[str]) -> dict:
    """A run's record with its check against ``ar``; a message in ``mismatches`` per
    divergence (near-tie or BUG)."""
    for div in check.divergences:
        mismatches.append(f"{label} differs from ar at context {n}, prompt {prompt.id}, "
                          f"{div.describe()}")
        (log.warning if div.is_tie else log.error)(mismatches[-1])
    first = check.divergences[0] if check.divergences else None
    return {"strategy": label, "context": n, "prompt": prompt.id, "repeat": rep,
            "prompt_tokens": len(prompt.ids), "matches_ar": first is None,
            "first_mismatch": None if first is None else first.position,
            "divergence": None if first is None else first.to_dict(),
            "check": check.to_dict(),
            "finish_reason": r.finish_reason, "token_ids": r.token_ids,
            "stats": r.stats.to_dict()}


def _uncompared(n: int, prompt: Prompt, label: str, rep: int, r, reference: list[int]) -> dict:
    """A run not compared with ``ar`` (rejection sampling: plain sampling's tokens in
    distribution only): ``matches_ar`` and ``check`` are None."""
    return {"strategy": label, "context": n, "prompt": prompt.id, "repeat": rep,
            "prompt_tokens": len(prompt.ids), "matches_ar": None,
            "first_mismatch": first_difference(reference, r.token_ids), "divergence": None,
            "check": None, "finish_reason": r.finish_reason, "token_ids": r.token_ids,
            "stats": r.stats.to_dict()}


def bugs(runs: list[dict]) -> list[dict]:
    """The runs with a difference from ``ar`` that is not a proven near-tie."""
    return [r for r in runs if r["check"] is not None and not r["check"]["correct"]]
