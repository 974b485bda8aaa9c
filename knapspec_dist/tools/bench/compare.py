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
from knapspec_dist.spec.ties import check_divergence
from knapspec_dist.tools.bench.prompts import Prompt

log = logging.getLogger(__name__)


def compare_strategies(model: Transformer, strategies: dict[str, Strategy],
                       prompts: dict[int, list[Prompt]], config: GenerationConfig,
                       save: Callable[[list[dict]], None] = lambda runs: None,
                       runner: ModelRunner | None = None) -> tuple[list[dict], list[str]]:
    """Every strategy on every prompt; returns the runs and the mismatch messages.

    The order of the strategies rotates from prompt to prompt, so a drifting machine favours
    none. Each run that differs from ``ar`` gets its first difference classified (one
    full-model forward, :func:`knapspec_dist.spec.ties.check_divergence`): ``divergence`` in
    the run's record, and a message saying near-tie or BUG. ``save`` gets the runs so far
    after each context.
    """
    labels = list(strategies)
    runs, mismatches = [], []
    for n, group in prompts.items():
        for j, prompt in enumerate(group):
            order = labels[j % len(labels):] + labels[:j % len(labels)]
            results = {}
            for label in order:
                r = generate(strategies[label], model, [prompt.ids], config, runner=runner)[0]
                results[label] = r
                s = r.stats
                log.info("context %d, %s, %s: %d tokens, %.2f tok/s (decode %.2f s), "
                         "acceptance %.2f", n, prompt.id, label, s.new_tokens, s.tokens_per_s,
                         s.wall_s - s.prefill_s, s.acceptance_rate)
            reference = results["ar"].token_ids
            for label in labels:
                r = results[label]
                div = check_divergence(model, prompt.ids, reference, r.token_ids)
                if div is not None:
                    mismatches.append(f"{label} differs from ar at context {n}, prompt "
                                      f"{prompt.id}, {div.describe()}")
                    (log.warning if div.is_tie else log.error)(mismatches[-1])
                runs.append({"strategy": label, "context": n, "prompt": prompt.id,
                             "prompt_tokens": len(prompt.ids), "matches_ar": div is None,
                             "first_mismatch": None if div is None else div.position,
                             "divergence": None if div is None else div.to_dict(),
                             "finish_reason": r.finish_reason,
                             "token_ids": r.token_ids, "stats": r.stats.to_dict()})
        save(runs)
    return runs, mismatches


def bugs(runs: list[dict]) -> list[dict]:
    """The runs whose difference from ``ar`` is not a proven near-tie."""
    return [r for r in runs if r.get("divergence") and r["divergence"]["verdict"] != "tie"]
