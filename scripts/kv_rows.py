"""Rows a replica's KV memory holds: fixed slots against a paged pool, by the engine's own rule.

For each model / tensor-parallel degree and each workload, the rows decoding at once that the
memory beside the weights holds, at ``MEMORY_UTILIZATION`` (0.9) of it (engine/memory.py's
``plan_kv``), with 512 new tokens per document and each row's cache positions as the
scheduler reserves them (``row_capacity``: prompt, new tokens and the draft lookahead):

- window: fixed slots of the model's whole window (a job's default ``--max-model-len``);
- longest: fixed slots of the job's longest document (``--max-model-len`` set to it);
- paged: one pool of pages (128 positions, one flex block, as on CUDA), a row holding the
  pages of its own length (engine/pages.py); the rows of the mean page count of the
  workload's documents.

Each is capped at 256, the GPU's ``max_num_seqs`` cap (engine/memory.py); the paged rows
before the cap are printed too. A document longer than the window is cut to fit it (a job's
``--truncate``): prompt + new tokens = window. KV bytes per position per rank:
``kv_bytes_per_token_of`` (2 x layers x KV heads per rank x head_dim x 2 bytes in bf16).

    python scripts/kv_rows.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from knapspec_dist.cli.common import emit
from knapspec_dist.engine.memory import GPU_CAP, kv_bytes_per_token_of, plan_kv
from knapspec_dist.engine.pages import pages_for
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.model.config import ModelConfig

H200 = 141e9  # bytes of HBM per GPU
NEW_TOKENS = 512
PAGE = 128  # positions per page on CUDA: one flex attention block
QUANTILES = 20_000  # points a continuous length distribution is integrated over


def model_config(arch: str, vocab: int, hidden: int, intermediate: int, layers: int,
                 heads: int, window: int) -> ModelConfig:
    """The published config's numbers (8 KV heads of 128 in both models)."""
    return ModelConfig(arch=arch, vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=intermediate, num_layers=layers, num_heads=heads,
                       num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       max_position_embeddings=window, tie_word_embeddings=False,
                       attention_bias=False, mlp_bias=False, rope={}, eos_token_ids=(0,))


LLAMA_70B = model_config("llama", 128256, 8192, 28672, 80, 64, 131072)
QWEN3_32B = model_config("qwen3", 151936, 5120, 25600, 64, 64, 40960)


@dataclass(frozen=True)
class Replica:
    name: str
    config: ModelConfig
    tp: int
    weights: float  # bytes of bf16 weights, all ranks together


REPLICAS = [Replica("Llama-3.1-70B", LLAMA_70B, 8, 141e9),
            Replica("Qwen3-32B", QWEN3_32B, 2, 65.5e9),
            Replica("Qwen3-32B", QWEN3_32B, 4, 65.5e9)]


def log_uniform(lo: int, hi: int) -> list[tuple[int, float]]:
    """(length, weight) at evenly spaced quantiles of a log-uniform distribution."""
    return [(round(lo * (hi / lo) ** ((i + 0.5) / QUANTILES)), 1 / QUANTILES)
            for i in range(QUANTILES)]


WORKLOADS = {
    "all 4k": [(4096, 1.0)],
    "1k-32k log-uniform": log_uniform(1024, 32768),
    "95 % 2k + 5 % 100k": [(2048, 0.95), (100_000, 0.05)],
}


def prompt_len(length: int, window: int) -> int:
    """A document's prompt, cut to the window with its new tokens (``--truncate``)."""
    return min(length, window - NEW_TOKENS)


def rows(replica: Replica, workload: list[tuple[int, float]]) -> dict:
    """Rows per replica under fixed slots (window, longest document) and pages."""
    cfg = replica.config
    window = cfg.max_position_embeddings
    per_token = kv_bytes_per_token_of(cfg, replica.tp, torch.bfloat16)
    free = int(H200 - replica.weights / replica.tp)  # beside this rank's weights
    longest = max(prompt_len(n, window) for n, _ in workload)
    def plan(capacity: int, paged: bool, cap: int | None = None):
        return plan_kv(per_token=per_token, free=free, capacity=capacity, paged=paged,
                       cuda=True, max_num_seqs=cap, page=PAGE if paged else None)

    # the paged pool before the row cap bounds it (a cap past any workload's rows)
    pages = plan(row_capacity(longest, NEW_TOKENS), True, cap=10 ** 9).pages
    mean = math.fsum(w * pages_for(row_capacity(prompt_len(n, window), NEW_TOKENS), PAGE)
                     for n, w in workload)
    paged = int(pages / mean)
    return {"per_token": per_token, "pool_gb": pages * PAGE * per_token / 1e9,
            "window": plan(row_capacity(window, 0), False).max_num_seqs,
            "longest": plan(row_capacity(longest, NEW_TOKENS), False).max_num_seqs,
            "paged": min(GPU_CAP, paged), "uncapped": paged,
            "truncated": longest < max(n for n, _ in workload)}


def table() -> list[str]:
    lines = ["| model | tp | KV bytes / position / rank | KV pool / rank | workload "
             "| rows: window / longest / paged | paged, uncapped |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for replica in REPLICAS:
        for name, workload in WORKLOADS.items():
            r = rows(replica, workload)
            job = name + (" (truncated)" if r["truncated"] else "")
            lines.append(f"| {replica.name} | {replica.tp} | {r['per_token']:,} | "
                         f"{r['pool_gb']:.1f} GB | {job} | {r['window']} / {r['longest']} / "
                         f"{r['paged']} | {r['uncapped']} |")
    return lines


if __name__ == "__main__":
    emit("\n".join(table()))
