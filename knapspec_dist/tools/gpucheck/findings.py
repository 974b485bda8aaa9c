"""gpu-check's findings section: the paper's four findings (tools/bench/findings.py, the same
functions as ``knapspec bench --preset findings``), ``knapspec:paper`` against its ablations,
our default and ``ar``, on SmolLM2 documents in bf16 (a random tiny model under ``--quick``).

One row per context, smallest first, each isolated (``Rows.add``): a context that raises is
that row's status. A context starts only while its section has time for it, judged by the last
context's wall time doubled (attention grows with the context); the rest say they were
skipped. Runs that differ from ``ar`` beyond a near-tie make the row's verdict BUG.
"""

from __future__ import annotations

import logging
import time

import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.profiles.profiler import measure
from knapspec_dist.tools.bench.compare import bugs
from knapspec_dist.tools.bench.findings import findings_markdown, run_findings
from knapspec_dist.tools.bench.prompts import ByteTokenizer, build_prompts
from knapspec_dist.tools.gpucheck.budget import Section
from knapspec_dist.tools.gpucheck.correct import RealModel, bf16_subject
from knapspec_dist.tools.gpucheck.rows import Rows

log = logging.getLogger(__name__)


def run_findings_section(device: torch.device, real: RealModel, section: Section, out: dict,
                         rows: Rows, *, contexts, new_tokens: int, interval: int,
                         profile_contexts) -> None:
    """One row per context into ``out["runs"]``: the findings there and every strategy's row."""
    subj = bf16_subject(device, real, out["notes"])
    out["model"], model = subj.name, subj.model
    tokenizer = subj.tokenizer or ByteTokenizer(model.cfg.vocab_size)
    docs = build_prompts(tokenizer, list(contexts), 1, model.cfg.max_position_embeddings,
                         new_tokens, "summarize")
    mode = "graph" if device.type == "cuda" else "eager"
    profile = rows.attempt(out["notes"], "profile", lambda: measure(
        model, contexts=profile_contexts, batch=1, repeats=2, mode=mode))
    config = GenerationConfig.of(max_new_tokens=new_tokens, stop_at_eos=False)
    runner = ModelRunner(model)
    need = 0.0
    for n in sorted(contexts):
        base = {"context": n, "prompt_tokens": len(docs[n][0].ids)}
        if profile is None:
            rows.skip(out["runs"], base, "skipped: no latency profile (see the notes)")
            continue

        def one(n=n) -> dict:
            nonlocal need
            start = time.perf_counter()
            result = run_findings(model, {n: docs[n]}, config, [profile], interval=interval,
                                  runner=runner)
            need = 2 * (time.perf_counter() - start)
            wrong = bugs(result["runs"])
            return {"findings": result["findings"], "rows": result["rows"],
                    "mismatches": result["mismatches"],
                    "verdict": "BUG" if wrong else "ok"}
        rows.add(out["runs"], base, one, section, need)


def markdown(section: dict) -> list[str]:
    """The findings table and the per-strategy rows of the contexts measured, then the rest."""
    ok = [r for r in section.get("runs", []) if r["status"] == "ok"]
    lines = findings_markdown({"findings": [f for r in ok for f in r["findings"]],
                               "rows": [x for r in ok for x in r["rows"]]}) if ok else []
    lines += [f"- context {r['context']}: {r['status']}" for r in section.get("runs", [])
              if r["status"] != "ok"]
    lines += [f"- {m}" for r in ok for m in r["mismatches"]]
    return lines or ["(none)"]
