"""``knapspec bench``: every strategy on the same long-document prompts, side by side.

    knapspec bench --model smollm2 --contexts 1024,2048,4096,8192 \\
        --strategies ar,clasp,knapspec,knapspec:coupled,knapspec:alpha,knapspec:once \\
        --new-tokens 128 --prompts 2 --out bench/

One process, one model; for each context length and each prompt every strategy runs in turn
(the order rotates from prompt to prompt, so a drifting machine does not favour one strategy).
Greedy decoding throughout: every strategy must emit exactly ``ar``'s tokens, and a mismatch is
an error (reported, recorded in the results, exit status 1). ``ar`` is always run, as the
reference, even when not listed.

Strategy specs (comma-separated in ``--strategies``):

* a name from :data:`knapspec_dist.strategies.NAMES` (``static`` needs a skip list);
* ``knapspec:FLAG[+FLAG...]`` (also ``clasp:``) with the ablation flags ``coupled``
  (attention and MLP of a layer skipped together), ``alpha`` (maximize acceptance instead of
  TPT) and ``once`` (select after prefill only);
* ``static:a3,m5@4``: the draft skips attention of layer 3 and MLP of layer 5 (0-based), draft
  length 4 (``+`` may replace the commas inside the skip list); ``clasp@4`` sets clasp's gamma.

Prompts: document ``j`` (0-based, ``--prompts K`` of them) starts at a chapter of book
``AUSTEN_BOOKS[j % 6]`` of the corpus (:func:`knapspec_dist.corpus.document_of_tokens`) and is
cut to the context length, so every context uses the same K documents, longer or shorter.
With a chat template (SmolLM2) the document is wrapped as a user message asking for a summary
(``--prompt-style summarize``, the default), and the whole prompt has the context's length; a
model without a tokenizer (the random test checkpoints) gets the documents' UTF-8 bytes as
token ids (modulo its vocabulary). A context that leaves no room for ``--new-tokens`` in the
model's window is shortened to fit (logged; the JSON keeps the real prompt length).

Every run emits ``--new-tokens`` tokens (EOS does not stop it unless ``--stop-at-eos``), so
rates compare like with like. Outputs in ``--out``: ``results.json`` (every run: strategy,
context, prompt, stats), ``results.md`` (a table per context), ``speedup.png`` and
``skipped.png``. Rates are given end to end (prefill included: ``stats.tokens_per_s``) and for
decoding only (tokens after the first / seconds after prefill); all strategies share the same
prefill, so the decode rate is where strategies differ.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import os
import platform
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import UserError

from .cli import emit

log = logging.getLogger(__name__)

FLAGS = {"coupled": {"coupled": True}, "alpha": {"objective": "alpha"},
         "once": {"select_once": True}, "tpt": {"objective": "tpt"}}
SUMMARIZE = "Summarize this text in a few sentences.\n\n"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# ----------------------------------------------------------------------------- strategy specs

@dataclass(frozen=True)
class StrategySpec:
    label: str  # as shown in tables and plots, canonical form of the spec
    options: object  # StrategyOptions


def parse_strategy(text: str):
    """One spec (``knapspec:coupled+once``, ``static:a3,m5@4``, ``clasp@4``) -> StrategySpec."""
    from .strategies import NAMES, StrategyOptions

    spec = text.strip()
    gamma = None
    m = re.fullmatch(r"(.*)@(\d+)", spec)
    if m:
        spec, gamma = m.group(1), int(m.group(2))
    name, colon, rest = spec.partition(":")
    if name not in NAMES:
        raise UserError(f"strategy {text!r}: unknown name {name!r}; choose one of "
                        f"{', '.join(NAMES)} (with :flags or @gamma)")
    if colon and not rest:
        raise UserError(f"strategy {text!r}: nothing after ':'")
    if gamma is not None and name not in ("static", "clasp"):
        raise UserError(f"strategy {text!r}: @gamma applies to static and clasp only")
    options = StrategyOptions(name=name)
    if gamma is not None:
        options = replace(options, gamma=gamma)
    parts = [p.strip() for p in re.split(r"[+,]", rest) if p.strip()]
    if name == "ar" and parts:
        raise UserError(f"strategy {text!r}: ar takes no options")
    if name == "static":
        if not parts:
            raise UserError(f"strategy {text!r}: static needs a skip list, e.g. static:a3,m5@4")
        options = replace(options, skip=",".join(parts))
    if name in ("knapspec", "clasp"):
        for flag in parts:
            if flag not in FLAGS:
                raise UserError(f"strategy {text!r}: unknown flag {flag!r}; choose from "
                                f"{', '.join(FLAGS)}")
            options = replace(options, **FLAGS[flag])
    label = name + (":" + "+".join(parts) if parts else "") + (f"@{gamma}" if gamma else "")
    if name == "static":
        label = f"static:{','.join(parts)}" + (f"@{gamma}" if gamma else "")
    return StrategySpec(label, options)


def parse_strategies(text: str) -> list[StrategySpec]:
    """Comma-separated specs; the commas inside a static skip list belong to it."""
    merged: list[str] = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        if (merged and merged[-1].startswith("static:") and "@" not in merged[-1]
                and re.fullmatch(r"[am]\d+(@\d+)?", tok)):
            merged[-1] += "," + tok
        else:
            merged.append(tok)
    specs = [parse_strategy(t) for t in merged]
    labels = [s.label for s in specs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise UserError(f"--strategies lists {', '.join(dupes)} more than once")
    if "ar" not in labels:
        log.info("adding ar, the reference every strategy is checked against")
        specs.insert(0, parse_strategy("ar"))
    return specs


def build(spec: StrategySpec, model):
    from .strategies import build_strategy

    try:
        return build_strategy(spec.options, model)
    except ModuleNotFoundError as e:
        if "knapspec_dist.speculation" not in str(e.name):
            raise
        raise UserError(f"strategy {spec.label!r} is not available in this build ({e.name} "
                        "missing)") from None


# ----------------------------------------------------------------------------- prompts

class ByteTokenizer:
    """UTF-8 bytes as token ids, for checkpoints without a tokenizer (the random test models)."""

    chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="ignore")

    def ids(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in self.encode(text)]


def resolve_tokenizer(name: str | None, model_path: Path, vocab_size: int):
    from .embedded import resolve_model_path
    from .loading import load_tokenizer

    if name == "bytes":
        return ByteTokenizer(vocab_size)
    if name is None:
        if not any((model_path / f).is_file() for f in TOKENIZER_FILES):
            log.warning("%s has no tokenizer: prompts are UTF-8 bytes as token ids", model_path)
            return ByteTokenizer(vocab_size)
        path = model_path
    else:
        path = resolve_model_path(name)
        if not path.exists():
            raise UserError(f"tokenizer path {str(path)!r} does not exist")
    tok = load_tokenizer(path)
    if len(tok) > vocab_size:
        raise UserError(f"tokenizer {str(path)!r} has {len(tok)} tokens; the model only "
                        f"{vocab_size}")
    return tok


@dataclass
class Prompt:
    id: str  # e.g. "emma-ch01": book and first chapter of the document
    context: int  # the context length asked for
    ids: list[int]


def _wrap(tokenizer, text: str, style: str) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.ids(text)
    if style == "summarize" and getattr(tokenizer, "chat_template", None):
        from .local import encode

        return encode(tokenizer, SUMMARIZE + text, chat=True)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def build_prompts(tokenizer, contexts: list[int], count: int, window: int, new_tokens: int,
                  style: str) -> dict[int, list[Prompt]]:
    from .corpus import AUSTEN_BOOKS, document_of_tokens

    longest = window - new_tokens - 1
    if longest < 2:
        raise UserError(f"--new-tokens {new_tokens} leaves no room for a prompt in the "
                        f"model's {window}-token window")
    overhead = len(_wrap(tokenizer, "x", style)) - 1  # template tokens around the document
    out: dict[int, list[Prompt]] = {}
    for n in contexts:
        target = n
        if n > longest:
            log.warning("context %d + %d new tokens exceed the %d-token window: prompts of %d "
                        "tokens", n, new_tokens, window, longest)
            target = longest
        if target - overhead < 1:
            raise UserError(f"context {n} is too short for the prompt template "
                            f"({overhead} tokens)")
        out[n] = []
        for j in range(count):
            book, chapter = AUSTEN_BOOKS[j % len(AUSTEN_BOOKS)], 7 * (j // len(AUSTEN_BOOKS))
            size = target - overhead
            for _ in range(4):  # BPE may merge differently inside the template: trim and retry
                ids = _wrap(tokenizer, document_of_tokens(tokenizer, size, book, chapter), style)
                if len(ids) <= target or size <= 1:
                    break
                size = max(1, size - (len(ids) - target))
            if len(ids) > target:
                raise UserError(f"cannot build a prompt of {target} tokens")  # pragma: no cover
            out[n].append(Prompt(f"{book}-ch{chapter + 1:02d}", n, ids))
            log.info("context %d, prompt %s: %d tokens", n, out[n][-1].id, len(ids))
    return out


# ----------------------------------------------------------------------------- running

def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(model, strategies: dict, prompts: dict[int, list[Prompt]], config,
        save=lambda runs: None) -> tuple[list[dict], list[str]]:
    """Every strategy on every prompt; returns the runs and the mismatch messages."""
    labels = list(strategies)
    runs, mismatches = [], []
    for n, group in prompts.items():
        for j, prompt in enumerate(group):
            order = labels[j % len(labels):] + labels[:j % len(labels)]
            results = {}
            for label in order:
                r = strategies[label].generate(model, [prompt.ids], config)[0]
                results[label] = r
                s = r.stats
                log.info("context %d, %s, %s: %d tokens, %.2f tok/s (decode %.2f s), "
                         "acceptance %.2f", n, prompt.id, label, s.new_tokens, s.tokens_per_s,
                         s.wall_s - s.prefill_s, s.acceptance_rate)
            reference = results["ar"].token_ids
            for label in labels:
                r = results[label]
                diff = first_difference(r.token_ids, reference)
                if diff is not None:
                    mismatches.append(f"{label} differs from ar at context {n}, prompt "
                                      f"{prompt.id}, from new token {diff} on")
                    log.error(mismatches[-1])
                runs.append({"strategy": label, "context": n, "prompt": prompt.id,
                             "prompt_tokens": len(prompt.ids), "matches_ar": diff is None,
                             "first_mismatch": diff, "finish_reason": r.finish_reason,
                             "token_ids": r.token_ids, "stats": r.stats.to_dict()})
        save(runs)
    return runs, mismatches


def summarize(runs: list[dict]) -> list[dict]:
    """Per (context, strategy): rates summed over prompts, speedups against ar."""
    rows = []
    keys = list(dict.fromkeys((r["context"], r["strategy"]) for r in runs))
    for n, label in keys:
        mine = [r["stats"] for r in runs if r["context"] == n and r["strategy"] == label]
        new = sum(s["new_tokens"] for s in mine)
        wall = sum(s["wall_s"] for s in mine)
        decode = sum(s["wall_s"] - s["prefill_s"] for s in mine)
        drafted = sum(s["drafted"] for s in mine)
        rows.append({
            "context": n, "strategy": label, "runs": len(mine),
            "prompt_tokens": sum(s["prompt_tokens"] for s in mine) / len(mine),
            "new_tokens": new,
            "tokens_per_s": new / wall if wall else 0.0,
            "decode_tokens_per_s": (new - len(mine)) / decode if decode else 0.0,
            "acceptance": sum(s["accepted"] for s in mine) / drafted if drafted else None,
            "attention_skipped": (sum(s["attention_skipped"] * s["drafted"] for s in mine)
                                  / drafted if drafted else 0.0),
            "mlp_skipped": (sum(s["mlp_skipped"] * s["drafted"] for s in mine) / drafted
                            if drafted else 0.0),
            "selection_pct": 100 * sum(s["select_s"] for s in mine) / wall if wall else 0.0,
            "selections": sum(s["selections"] for s in mine),
            "fallbacks": sum(s.get("fallbacks", 0) for s in mine),
            "draft_s": sum(s["draft_s"] for s in mine),
            "verify_s": sum(s["verify_s"] for s in mine),
            "matches_ar": all(r["matches_ar"] for r in runs
                              if r["context"] == n and r["strategy"] == label),
        })
    for row in rows:
        ar = next(r for r in rows if r["context"] == row["context"] and r["strategy"] == "ar")
        row["speedup"] = row["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] else 0.0
        row["decode_speedup"] = (row["decode_tokens_per_s"] / ar["decode_tokens_per_s"]
                                 if ar["decode_tokens_per_s"] else 0.0)
    return rows


# ----------------------------------------------------------------------------- reporting

def machine(device: str) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def command_line(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The command that repeats this run, every option spelled out."""
    words = ["knapspec", "bench"]
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        value = getattr(args, action.dest, None)
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                words.append(flag)
        elif value is not None:
            words += [flag, str(value)]
    return shlex.join(words)


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def write_markdown(path: Path, header: dict, rows: list[dict], mismatches: list[str]) -> None:
    m = header["machine"]
    machine_line = f"{m['cpu']}, {m['torch_threads']} torch threads ({m['cpu_count']} CPUs)"
    if m.get("gpu"):
        machine_line += f", GPU {m['gpu']}"
    lines = [
        "# knapspec bench", "",
        f"- command: `{header['command']}`",
        f"- machine: {machine_line}",
        f"- date: {header['date']}",
        f"- torch {header['torch']}, model {header['model']} ({header['dtype']}, "
        f"{header['device']}), greedy, {header['new_tokens']} new tokens, "
        f"{header['prompts']} prompt(s) per context",
        "",
        "tok/s: new tokens / wall seconds, prefill included; decode tok/s: tokens after the "
        "first / seconds after prefill (the part strategies change). Speedups are against "
        "`ar` on the same prompts. Skipped: mean attention / MLP sublayers skipped per drafted "
        "token. Selection: select_s / wall_s; selections (fallbacks): subnet selections run, "
        "and plans the guard dropped for plain decoding after their drafts fell short.", "",
    ]
    if mismatches:
        lines += ["**ERROR: outputs differ from `ar`:**", ""] + [f"- {x}" for x in mismatches]
        lines.append("")
    for n in dict.fromkeys(r["context"] for r in rows):
        group = [r for r in rows if r["context"] == n]
        lines += [f"## context {n} (prompt {group[0]['prompt_tokens']:.0f} tokens)", "",
                  "| strategy | tok/s | speedup | decode tok/s | decode speedup | acceptance "
                  "| attn skipped | MLP skipped | selection % | selections (fallbacks) "
                  "| same tokens as ar |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
        for r in group:
            lines.append(
                f"| {r['strategy']} | {r['tokens_per_s']:.2f} | {r['speedup']:.3f}x | "
                f"{r['decode_tokens_per_s']:.2f} | {r['decode_speedup']:.3f}x | "
                f"{_fmt(r['acceptance'], '.3f')} | {r['attention_skipped']:.1f} | "
                f"{r['mlp_skipped']:.1f} | {r['selection_pct']:.1f} | "
                f"{r.get('selections', 0)} ({r.get('fallbacks', 0)}) | "
                f"{'yes' if r['matches_ar'] else '**NO**'} |")
        lines.append("")
    path.write_text("\n".join(lines))


def plot(out: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["strategy"] for r in rows))
    contexts = sorted({r["context"] for r in rows})
    series = {label: sorted((r for r in rows if r["strategy"] == label),
                            key=lambda r: r["context"]) for label in labels}

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, title in ((axes[0], "decode_speedup", "decode only"),
                           (axes[1], "speedup", "end to end (prefill included)")):
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        for label in labels:
            if label == "ar":
                continue
            pts = series[label]
            ax.plot([r["context"] for r in pts], [r[key] for r in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup vs ar")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, label in enumerate(x for x in labels if x != "ar"):
        pts, c = series[label], colors[k % len(colors)]
        xs = [r["context"] for r in pts]
        ax.plot(xs, [r["attention_skipped"] for r in pts], marker="o", color=c,
                label=f"{label}: attention")
        ax.plot(xs, [r["mlp_skipped"] for r in pts], marker="s", linestyle="--", color=c,
                label=f"{label}: MLP")
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("sublayers skipped per drafted token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "skipped.png", dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- command

def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{what}: expected positive integers, got {text!r}")
    return values


def cmd_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import torch

    from .embedded import resolve_model_path
    from .loading import load_model, resolve_dtype
    from .local import resolve_device
    from .speculation.strategy import GenerationConfig

    contexts = _ints(args.contexts, "--contexts")
    if args.new_tokens < 1 or args.prompts < 1:
        raise UserError("--new-tokens and --prompts must be >= 1")
    specs = parse_strategies(args.strategies)
    if args.profile is not None and not Path(args.profile).is_file():
        raise UserError(f"--profile {args.profile!r}: no such file")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    path = resolve_model_path(args.model)
    if not path.exists():
        raise UserError(f"model path {str(path)!r} does not exist")
    model = load_model(path, dtype=resolve_dtype(args.dtype), device=resolve_device(args.device))
    tokenizer = resolve_tokenizer(args.tokenizer, path, model.cfg.vocab_size)
    profile, profile_name = args.profile, args.profile
    if any(s.options.name in ("knapspec", "clasp") for s in specs):
        # One profile for every selecting strategy: found, loaded or measured once, not per spec.
        from .profiles.store import resolve_profile

        profile = resolve_profile(args.profile, model)
        profile_name = args.profile or profile.key()
    specs = [StrategySpec(s.label, replace(s.options, profile=profile, interval=args.interval,
                                           tau_conf=args.tau_conf)) for s in specs]
    strategies = {s.label: build(s, model) for s in specs}
    prompts = build_prompts(tokenizer, contexts, args.prompts, model.cfg.max_position_embeddings,
                            args.new_tokens, args.prompt_style)
    config = GenerationConfig(max_new_tokens=args.new_tokens, stop_at_eos=args.stop_at_eos)

    header = {"command": command_line(args, parser), "machine": machine(args.device),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "torch": torch.__version__, "model": str(path), "dtype": args.dtype,
              "device": args.device, "new_tokens": args.new_tokens, "prompts": args.prompts,
              "contexts": contexts, "profile": profile_name,
              "strategies": {s.label: {**vars(s.options), "profile": profile_name}
                             for s in specs}}
    log.info("bench: %s", header["command"])

    if not args.no_warmup:
        warm = GenerationConfig(max_new_tokens=min(4, args.new_tokens), stop_at_eos=False)
        first = prompts[contexts[0]][0].ids
        for label, strategy in strategies.items():
            strategy.generate(model, [first[:64]], warm)
        log.info("warmed up")

    def save(runs: list[dict], mismatches: list[str] | None = None) -> None:
        doc = {**header, "mismatches": mismatches or [], "runs": runs}
        if mismatches is not None:
            doc["summary"] = summarize(runs)
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(out / "results.json")

    runs, mismatches = run(model, strategies, prompts, config, save)
    save(runs, mismatches)
    rows = summarize(runs)
    write_markdown(out / "results.md", header, rows, mismatches)
    plot(out, rows)
    emit(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'speedup.png'}, "
          f"{out / 'skipped.png'}")
    if mismatches:
        emit(f"error: {len(mismatches)} run(s) differ from ar; first: {mismatches[0]}",
             error=True)
        return 1
    return 0


def register(sub) -> None:
    from .cli import _add_model_args

    p = sub.add_parser("bench", help="compare strategies on long-document prompts",
                       description=__doc__.split("\n\n")[0].strip("`"))
    _add_model_args(p)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or 'smollm2' (default: the model's own; 'bytes' or a "
                        "model without one: UTF-8 bytes as token ids)")
    p.add_argument("--contexts", default="1024,2048,4096,8192",
                   help="prompt lengths in tokens, comma-separated")
    p.add_argument("--strategies", default="ar,clasp,knapspec",
                   help="specs like ar,clasp,knapspec,knapspec:coupled,knapspec:alpha,"
                        "knapspec:once,static:a3,m5@4")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=2, help="documents per context")
    p.add_argument("--prompt-style", default="summarize", choices=["summarize", "continue"],
                   help="summarize: chat-wrapped summary request (if the tokenizer has a chat "
                        "template); continue: the bare document")
    p.add_argument("--profile", default=None, help="latency profile JSON (knapspec, clasp)")
    p.add_argument("--interval", type=int, default=64, help="tokens between re-selections")
    p.add_argument("--tau-conf", type=float, default=0.7, help="draft confidence early exit")
    p.add_argument("--stop-at-eos", action="store_true", help="stop a run at EOS")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=functools.partial(cmd_bench, parser=p))
