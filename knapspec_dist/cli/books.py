"""``knapspec books``: whole books of the corpus summarized through the job's trees.

    knapspec books --books persuasion --strategies ar,knapspec --out docs/bench/books
    knapspec books --strategies ar --draws 3 --chunk-tokens 2048 --out /tmp/books-2048
    knapspec books --books emma+northangerabbey --short-rows 20 --strategies ar --out /tmp/mix

Each strategy runs the summarization job over the books (``--long-documents tree``, the
demo's seeded sampling),
then a truncated ``ar`` job gives the summary of what fits the window; ``--draws N`` repeats
each book N times in the same jobs, each copy with its own seeds. Prints and writes
(``books.md``, ``books.json``) the time, generations, depth and tokens of each level, the
speedup over ``ar``'s tree, and the main characters each summary keeps (tools/books.py).
``a+b`` joins books into one document; ``--short-rows N`` puts N short rows (paragraphs of
another book) in the same input, and the report says when they and the books ended and how
near the progress line's ETA was to the time each pass had left. Not part of ``make test``:
a novel takes minutes per strategy on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
from pathlib import Path

from knapspec_dist.cli.common import add_number, emit
from knapspec_dist.cli.demo import DEMO_TEMPERATURE, DEMO_TOP_P
from knapspec_dist.errors import UserError
from knapspec_dist.tools.bench.report import command_line, machine
from knapspec_dist.tools.bench.specs import parse_strategies
from knapspec_dist.tools.books import (
    draw_id,
    report,
    run_books,
    schedule_table,
    short_texts,
    table,
)
from knapspec_dist.tools.corpus import AUSTEN_BOOKS, book_path


def register(sub) -> None:
    p = sub.add_parser("books", help="whole books through summary trees: time, depth, quality",
                       description=__doc__.split("\n\n")[0].strip("`"))
    p.add_argument("--books", default="northangerabbey",
                   help=f"comma-separated, of {', '.join(AUSTEN_BOOKS)}; a+b joins books into "
                        "one document (default northangerabbey)")
    p.add_argument("--corpus", default=None, help="the corpus folder (default: the shared one)")
    p.add_argument("--model", default="smollm2", help="model folder, or 'smollm2' (embedded)")
    p.add_argument("--strategies", default="ar,knapspec")
    add_number(p, "--max-new-tokens", default=128)
    add_number(p, "--max-model-len", default=None)
    add_number(p, "--chunk-tokens", default=None)
    add_number(p, "--chunk-overlap", default=0)
    add_number(p, "--tree-fan-in", default=None)
    add_number(p, "--max-num-seqs", default=None)
    add_number(p, "--temperature", default=DEMO_TEMPERATURE,
               help=f"the demo's sampling by default (a 135M model's greedy summaries loop): "
                    f"temperature {DEMO_TEMPERATURE}, top-p {DEMO_TOP_P}, seed 0; coupled, so "
                    "every strategy's tokens are ar's")
    add_number(p, "--top-p", default=DEMO_TOP_P)
    add_number(p, "--seed", default=0)
    add_number(p, "--short-rows", default=0,
               help="short rows beside the books (paragraphs of 60-200 words of a book not "
                    "in --books), for the schedule and the progress line's ETA (default 0)")
    add_number(p, "--draws", default=1,
               help="copies of each book in the jobs, each sampled with its own seeds (its "
                    "row id's): the characters kept are read over them (default 1)")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(func=functools.partial(cmd_books, parser=p))


def cmd_books(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    books = {}
    for name in args.books.split(","):
        text = "\n\n".join(_book(part.strip(), args.corpus) for part in name.split("+"))
        books |= {draw_id(name.strip(), d): text for d in range(args.draws)}
    shorts = None
    if args.short_rows:
        used = {part.strip() for name in args.books.split(",") for part in name.split("+")}
        other = next(b for b in AUSTEN_BOOKS if b not in used)
        shorts = short_texts(_book(other, args.corpus), args.short_rows)
    strategies = {s.label: s.options for s in parse_strategies(args.strategies)}
    if "ar" not in strategies:
        raise UserError("--strategies must include ar: the speedup is over ar's tree")
    base = {"model": args.model, "max_new_tokens": args.max_new_tokens,
            "max_model_len": args.max_model_len, "chunk_tokens": args.chunk_tokens,
            "chunk_overlap": args.chunk_overlap,
            "tree_fan_in": args.tree_fan_in,
            "max_num_seqs": args.max_num_seqs, "temperature": args.temperature,
            "top_p": args.top_p, "seed": args.seed, "progress_bar": False}
    out = Path(args.out)
    result = report(books, run_books(books, out, base, strategies, shorts))
    header = {"command": command_line(args, parser), "machine": machine("cpu"),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    (out / "books.json").write_text(json.dumps({**header, **result}, indent=1))
    lines = table(result) + ["", "Schedule: the short rows beside the books, and the "
                             "progress line's ETA against the time the pass had left, from "
                             "a tenth of the pass to its last twentieth:", ""] + schedule_table(
                                 result)
    m = header["machine"]
    (out / "books.md").write_text(
        f"# knapspec books ({header['date']})\n\n`{header['command']}`\n\n{m['cpu']} "
        f"({m['cpu_count']} CPUs); temperature {args.temperature}, top-p {args.top_p}, seed "
        f"{args.seed} (coupled), {args.max_new_tokens} new tokens a node, {args.draws} draw(s) "
        f"a book, {args.short_rows} short row(s).\n\n"
        + "\n".join(lines) + "\n")
    emit("\n".join(lines))
    return 0


def _book(name: str, corpus: str | None) -> str:
    path = book_path(name, corpus)
    if path is None:
        raise UserError(f"--books: no book {name!r} in the corpus (of {', '.join(AUSTEN_BOOKS)})")
    return path.read_text(encoding="utf-8")
