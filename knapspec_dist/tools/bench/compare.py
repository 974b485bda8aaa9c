"""``knapspec bench``'s measurement: every strategy on every prompt, each run checked
against ``ar``'s tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.engine.strategy import Strategy
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.tools.ties import check_divergence, first_difference
from knapspec_dist.tools.bench.prompts import Prompt

log = logging.getLogger(__name__)


def compare_strategies(model: Transformer, strategies: dict[str, Strategy],
                       prompts: dict[int, list[Prompt]], config: GenerationConfig,
                       save: Callable[[list[dict]], None] = lambda runs: None,
                       runner: ModelRunner | None = None, repeats: int = 1
                       ) -> tuple[list[dict], list[str]]:
    """Every strategy on every prompt, ``repeats`` times; returns the runs and the mismatch
    messages.

    The order of the strategies rotates from prompt to prompt and from repeat to repeat, so a
    drifting machine favours none (a prompt's repeats run back to back, interleaved). Each run that differs from ``ar`` gets its first difference classified (one
    full-model forward, :func:`knapspec_dist.tools.ties.check_divergence`): ``divergence`` in
    the run's record, and a message saying near-tie or BUG. ``save`` gets the runs so far
    after each context.
    """
    labels = list(strategies)
    runs, mismatches = [], []
    for n, group in prompts.items():
        for j, prompt in enumerate(group):
            for rep in range(repeats):
                k = (j + rep) % len(labels)
                results = {label: generate(strategies[label], model, [prompt.ids], config,
                                           runner=runner)[0]
                           for label in labels[k:] + labels[:k]}
                for label, r in results.items():
                    s = r.stats
                    log.info("context %d, %s, %s (repeat %d): %d tokens, %.2f tok/s (decode "
                             "%.2f s), acceptance %.2f", n, prompt.id, label, rep + 1,
                             s.new_tokens, s.tokens_per_s, s.wall_s - s.prefill_s,
                             s.acceptance_rate)
                for label in labels:
                    runs.append(_checked(model, n, prompt, label, rep, results[label],
                                         results["ar"].token_ids, mismatches,
                                         label == "ar" or config.sampling.identical_to_plain))
        save(runs)
    return runs, mismatches


def _checked(model: Transformer, n: int, prompt: Prompt, label: str, rep: int, r,
             reference: list[int], mismatches: list[str], compared: bool = True) -> dict:
    """A run's record, its first difference from ``ar``'s ``reference`` classified (a
    message in ``mismatches``: near-tie or BUG). Not ``compared`` (rejection sampling, whose
    tokens are plain sampling's in distribution only): ``matches_ar`` is None."""
    if not compared:
        return {**_record(n, prompt, label, rep, r), "matches_ar": None,
                "first_mismatch": first_difference(reference, r.token_ids), "divergence": None}
    div = check_divergence(model, prompt.ids, reference, r.token_ids)
    if div is not None:
        mismatches.append(f"{label} differs from ar at context {n}, prompt {prompt.id}, "
                          f"{div.describe()}")
        (log.warning if div.is_tie else log.error)(mismatches[-1])
    return {**_record(n, prompt, label, rep, r), "matches_ar": div is None,
            "first_mismatch": None if div is None else div.position,
            "divergence": None if div is None else div.to_dict()}


def _record(n: int, prompt: Prompt, label: str, rep: int, r) -> dict:
    return {"strategy": label, "context": n, "prompt": prompt.id, "repeat": rep,
            "prompt_tokens": len(prompt.ids), "finish_reason": r.finish_reason,
            "token_ids": r.token_ids, "stats": r.stats.to_dict()}


def bugs(runs: list[dict]) -> list[dict]:
    """The runs whose difference from ``ar`` is not a proven near-tie."""
    return [r for r in runs if r.get("divergence") and r["divergence"]["verdict"] != "tie"]
