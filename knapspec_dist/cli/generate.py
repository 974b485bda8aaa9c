"""``knapspec generate``: every ``--prompt`` / ``--prompt-file`` (repeatable), continuously
batched (``--max-num-seqs`` rows at once), in process or, with ``--tp`` / ``--replicas`` /
``--address``, on the Ray engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from knapspec_dist.cli.common import (
    add_engine_args,
    add_model_args,
    add_number,
    add_sampling_args,
    add_strategy_args,
    generation_config,
    strategy_options,
    uses_engine,
)
from knapspec_dist.engine.generation import GenerationConfig, GenerationResult
from knapspec_dist.engine.memory import MEMORY_UTILIZATION
from knapspec_dist.errors import UserError
from knapspec_dist.llm import generate_texts, load
from knapspec_dist.model.tokenizer import encode
from knapspec_dist.runtime.ray_engine import RayEngine
from knapspec_dist.speculation.options import StrategyOptions


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate from one or more prompts (batched)")
    add_model_args(g)
    add_engine_args(g)  # --tp / --replicas / --address: the Ray engine
    g.add_argument("--prompt", action="append", help="a prompt (repeat for more)")
    g.add_argument("--prompt-file", action="append", help="a file holding one prompt (repeatable)")
    add_number(g, "--max-num-seqs", default=None,
               help="cap on the prompts decoded at once, as the KV cache allows (default "
                    "256 on a GPU, 16 on a CPU)")
    add_number(g, "--kv-cache-memory", metavar="SIZE",
               help="KV cache per rank, whole bytes or a number with a unit (2GiB, 1.5GB); "
                    "default: --memory-utilization of the memory free after the weights load")
    add_number(g, "--memory-utilization", default=MEMORY_UTILIZATION,
               help="share of the free memory the KV cache takes when --kv-cache-memory "
                    f"is not given (default {MEMORY_UTILIZATION})")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_strategy_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    texts = prompt_texts(args.prompt or [], args.prompt_file or [])
    options, config = strategy_options(args), generation_config(args)
    if uses_engine(args):
        results = generate_on_engine(args, texts, options, config)
    else:
        loaded = load(args.model, args.dtype, args.device)
        prompts = [encode(loaded.tokenizer, text, args.chat) for text in texts]
        results = generate_texts(loaded, prompts, options, config, args.max_num_seqs,
                                 kv_cache_memory=args.kv_cache_memory,
                                 memory_utilization=args.memory_utilization)
    for result in results:
        print_result(result, options.name, args.json, config.sampling.label)
    return 0


def prompt_texts(prompts: list[str], files: list[str]) -> list[str]:
    """The ``--prompt`` texts, then the ``--prompt-file`` contents (UTF-8); at least one."""
    texts = list(prompts)
    for path in files:
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise UserError(f"cannot read prompt file {path!r}: {e.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"prompt file {path!r} is not valid UTF-8: {e.reason} (byte "
                            f"0x{raw[e.start:e.start + 1].hex()} at offset {e.start}); "
                            "save it as UTF-8") from None
        texts.append(text.replace("\r\n", "\n").replace("\r", "\n"))  # as read_text() did
    if not texts:
        raise UserError("give --prompt or --prompt-file (each may repeat)")
    return texts


def generate_on_engine(args: argparse.Namespace, texts: list[str], options: StrategyOptions,
                       config: GenerationConfig) -> list[GenerationResult]:
    """The prompts through the Ray engine, continuously batched in its replicas; their results
    (text filled), in order."""
    with RayEngine(args.model, tp=args.tp, replicas=args.replicas, strategy=options,
                dtype=args.dtype, device=args.device, address=args.address,
                cpus_per_rank=args.cpus_per_rank, max_num_seqs=args.max_num_seqs,
                kv_cache_memory=args.kv_cache_memory,
                memory_utilization=args.memory_utilization) as engine:
        return engine.generate(texts, config, chat=args.chat)


def print_result(result: GenerationResult, strategy: str, as_json: bool,
                 sampling: str = "greedy") -> None:
    """One result: a JSON line, or the text on stdout and its rates on stderr; ``sampling``:
    how its tokens were drawn (``SamplingConfig.label``)."""
    s = result.stats
    if as_json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text,
                          "finish_reason": result.finish_reason, "sampling": sampling,
                          "stats": s.to_dict()}))
        return
    print(result.text)
    rate, acceptance = s.tokens_per_s, s.acceptance_rate
    print(f"\n[{strategy}, {sampling}] {s.new_tokens} tokens in {s.wall_s:.2f}s "
          f"({'-' if rate is None else f'{rate:.1f}'} tok/s), prompt {s.prompt_tokens} tokens, "
          f"acceptance {'-' if acceptance is None else f'{acceptance:.2f}'} "
          f"({s.accepted}/{s.drafted})", file=sys.stderr)
