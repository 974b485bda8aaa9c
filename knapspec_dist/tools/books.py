"""Whole books through the job's summary trees: time, generations, depth, tokens per level,
the speedup over the tree, and whether the summary keeps the book's main characters.

Each strategy runs the same job (``run_job``, its trees, greedy decoding) into an output folder
of its own; a truncated job (``--long-documents truncate``, ``ar``) gives the summary of what
fits the window, for the quality check. The main characters are the book's most frequent
capitalized names (:func:`main_characters`); a summary keeps those it names. One sampled
summary keeps a few of ten, and the next draw another few: ``draws`` repeats each book in the
same job under ids of their own (each its own seeds, :func:`draw_id`), and the quality is
read over the draws.
"""

from __future__ import annotations

import collections
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from knapspec_dist.jobs.options import JobConfig
from knapspec_dist.jobs.output import NODES, ROWS
from knapspec_dist.jobs.runner import run_job
from knapspec_dist.ratio import ratio
from knapspec_dist.runtime.chunking import chunk_document
from knapspec_dist.runtime.prompts import load_text_tools, make_builder

log = logging.getLogger(__name__)

#: Capitalized words that name no one: titles, pronouns, months, the text's own furniture.
NOT_NAMES = frozenset("""I Mr Mrs Miss Sir Lady Lord Dr Colonel Captain Admiral General Chapter
Volume The A An And But Or If In On At Of To For With By As It He She They We You His Her
Their Our My Me Him Them Oh No Yes Not Nor So Then There This That These Those What When
Where Why How Who Whom Which While Though Although Monday Tuesday Wednesday Thursday Friday
Saturday Sunday January February March April May June July August September October November
December Christmas God Heaven English England London Bath Well Now Do Did Is Was Be""".split())


def main_characters(text: str, k: int = 10) -> list[str]:
    """The ``k`` most frequent capitalized words of ``text`` that are names: not in
    :data:`NOT_NAMES` and seldom written in lower case (a word that starts sentences is)."""
    capital = collections.Counter(re.findall(r"\b[A-Z][a-z]{2,}\b", text))
    lower = collections.Counter(re.findall(r"\b[a-z]{3,}\b", text))
    names = [(n, w) for w, n in capital.items()
             if w not in NOT_NAMES and lower[w.lower()] < 0.05 * n]
    return [w for _, w in sorted(names, key=lambda nw: (-nw[0], nw[1]))[:k]]


def kept(summary: str | None, names: list[str]) -> list[str]:
    """The names a summary mentions."""
    return [n for n in names if summary and re.search(rf"\b{re.escape(n)}\b", summary)]


CHUNK_NAMES = 5  # a chunk's own main characters that its summary is checked for


def chunk_recall(chunks: list[str], summaries: dict[int, str | None]) -> float | None:
    """The mean, over a tree's chunks, of the share of each chunk's own main characters
    (its ``CHUNK_NAMES`` most frequent names) that the chunk's summary (by index) names:
    a leaf's quality, read over dozens of summaries where the root is one."""
    shares = []
    for i, text in enumerate(chunks):
        names = main_characters(text, CHUNK_NAMES)
        if names and i in summaries:
            shares.append(len(kept(summaries[i], names)) / len(names))
    return sum(shares) / len(shares) if shares else None


def chunk_texts(config: JobConfig, text: str) -> list[str]:
    """The chunks the job cut ``text`` into (the same builder's size and overlap: the cut is
    deterministic)."""
    shape = config.tree_shape()
    builder = make_builder(load_text_tools, config, config.mode, config.instruction,
                           config.max_model_len, config.max_new_tokens, False,
                           config.input_column, shape)
    return [c.text for c in chunk_document(text, builder.tokenizer, builder.chunk_tokens,
                                           shape.overlap)]


DRAW_MARK = "~"


def draw_id(book: str, draw: int) -> str:
    """The row id of a book's ``draw``-th copy: the book's name for the first (so one draw
    samples what a run of one book does), ``name~d`` after it."""
    return book if draw == 0 else f"{book}{DRAW_MARK}{draw}"


def book_of(row_id: str) -> str:
    return row_id.split(DRAW_MARK)[0]


@dataclass
class Run:
    """One job over the books: its folder, wall seconds and rows."""

    label: str
    out: Path
    wall_s: float
    rows: dict
    nodes: list
    chunks: dict = field(default_factory=dict)  # book text -> its chunks' texts (trees)
    started: float = 0.0  # epoch seconds
    lines: list = field(default_factory=list)  # its progress lines: (epoch seconds, text)


SHORT = "short"  # the short rows' ids: short-0, short-1, ...


def short_texts(text: str, n: int, words: tuple[int, int] = (60, 200)) -> dict[str, str]:
    """``n`` short rows beside the books: the first paragraphs of ``text`` of ``words``
    words (as a user's articles beside one book)."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text)]
    chosen = [p for p in paragraphs if words[0] <= len(p.split()) <= words[1]][:n]
    if len(chosen) < n:
        raise ValueError(f"only {len(chosen)} paragraphs of {words[0]}-{words[1]} words")
    return {f"{SHORT}-{i}": p for i, p in enumerate(chosen)}


class ProgressLines(logging.Handler):
    """Keeps the job's progress lines with the time each was logged: the ETA they showed
    against the time the pass really had left (:func:`eta_accuracy`)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.created, record.getMessage()))


def _seconds(text: str) -> float:
    """A progress line's ``1h02m03s`` / ``2m03s`` / ``3s`` as seconds."""
    h, m, s = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(\d+)s", text).groups()
    return int(h or 0) * 3600 + int(m or 0) * 60 + int(s)


def eta_accuracy(lines: list[tuple[float, str]], label: str = "rows",
                 window: tuple[float, float] = (0.1, 0.95)) -> dict | None:
    """The ETA of each ``label`` progress line from the first tenth of the pass to its last
    twentieth, against the time the pass then had left (its last line: the pass's end), as
    ratios of the larger over the smaller; None without such lines."""
    mine = [(t, m) for t, m in lines if m.startswith(f"{label}: ")]
    if len(mine) < 3:
        return None
    start = mine[0][0] - _seconds(re.search(r"elapsed (\S+),", mine[0][1]).group(1))
    end = mine[-1][0]
    ratios = []
    for t, m in mine:
        eta = re.search(r"ETA (\S+?)[;,]?(?: |$)", m).group(1)
        left = end - t
        if eta == "?" or not window[0] <= (t - start) / (end - start) <= window[1] or left <= 0:
            continue
        guess = _seconds(eta)
        ratios.append(max(guess, 1) / left if guess >= left else left / max(guess, 1))
    if not ratios:
        return None
    ordered = sorted(ratios)
    return {"lines": len(ratios), "max": ordered[-1], "median": ordered[len(ordered) // 2],
            "within_1_5": sum(r <= 1.5 for r in ratios) / len(ratios),
            "pass_s": end - start}


def schedule(run: Run) -> dict:
    """When the short rows and the books ended, in seconds after the job started, and how
    the progress line's ETA held (:func:`eta_accuracy`)."""
    ends = {k: r["finished_at"].timestamp() - run.started for k, r in run.rows.items()
            if r.get("finished_at") is not None}
    shorts = [v for k, v in ends.items() if k.startswith(SHORT)]
    books = [v for k, v in ends.items() if not k.startswith(SHORT)]
    return {"short_rows": len(shorts), "short_rows_done_s": max(shorts, default=None),
            "books_done_s": max(books, default=None), "eta": eta_accuracy(run.lines)}


def run_books(books: dict[str, str], out: Path, base: dict, strategies: dict,
              shorts: dict[str, str] | None = None) -> dict[str, Run]:
    """The job of ``books`` (name -> text) once per strategy (label -> StrategyOptions or
    name) with trees, and once truncated with ``ar``; ``base``: JobConfig's other options;
    ``shorts``: short rows (id -> text) in the same input, after the books."""
    out.mkdir(parents=True, exist_ok=True)
    source = out / "books.parquet"
    rows = {**books, **(shorts or {})}
    pq.write_table(pa.table({"id": list(rows), "document": list(rows.values())}), source)
    plans = {label: {"strategy": s, "long_documents": "tree"} for label, s in strategies.items()}
    plans["truncate"] = {"strategy": "ar", "long_documents": "truncate"}
    runs, chunks = {}, None
    for label, options in plans.items():
        folder = out / label
        config = JobConfig(input=str(source), output=str(folder), baseline_fraction=0,
                           **base, **options)
        log.info("books: %s", label)
        lines, progress = ProgressLines(), logging.getLogger("knapspec_dist.jobs.progress")
        progress.addHandler(lines)
        started, start = time.time(), time.monotonic()
        try:
            run_job(config)
        finally:
            progress.removeHandler(lines)
        wall = time.monotonic() - start
        rows = {r["id"]: r for r in pq.read_table(folder / ROWS).to_pylist()}
        nodes = (pq.read_table(folder / NODES).to_pylist()
                 if any((folder / NODES).glob("*.parquet")) else [])
        tree = options["long_documents"] == "tree"
        if tree and chunks is None:  # every strategy's tree cuts the same chunks
            chunks = {text: chunk_texts(config, text) for text in set(books.values())}
        runs[label] = Run(label, folder, wall, rows, nodes, chunks if tree else {}, started,
                          lines.lines)
    return runs


def report(books: dict[str, str], runs: dict[str, Run]) -> dict:
    """Per book and strategy: time, generations, depth, tokens per level, the speedup over
    ``ar``'s tree, tokens identical to ``ar``'s; per book: the main characters kept."""
    out: dict = {"books": {}}
    trees = [label for label in runs if label != "truncate"]
    for book, text in books.items():
        names = main_characters(text)
        entry = {"characters": names, "strategies": {}}
        for label in trees:
            run = runs[label]
            row = run.rows[book]
            levels: dict[int, dict] = {}
            texts: dict[int, list[str]] = {}
            leaves: dict[int, str | None] = {}  # level 0's summaries by chunk
            for n in run.nodes:
                if n["id"] == book:
                    acc = levels.setdefault(n["level"], {"level": n["level"], "nodes": 0,
                                                        "prompt_tokens": 0,
                                                        "generated_tokens": 0})
                    acc["nodes"] += 1
                    acc["prompt_tokens"] += n["num_input_tokens"]
                    acc["generated_tokens"] += n["num_generated_tokens"]
                    texts.setdefault(n["level"], []).append(n["generated_text"] or "")
                    if n["level"] == 0:
                        leaves[n["index"]] = n["generated_text"]
            for level, acc in levels.items():  # where names are lost: each level's together
                acc["characters_kept"] = len(kept(" ".join(texts[level]), names))
            ar_row = runs["ar"].rows[book] if "ar" in runs else None
            entry["strategies"][label] = {
                "error": row["error"], "path": row["document_path"],
                "chunks": row["tree_chunks"], "depth": row["tree_depth"],
                "generations": row["tree_generations"],
                "generation_s": row["time_taken_llm"],
                "tree_speedup": None if ar_row is None else ratio(
                    ar_row["time_taken_llm"], row["time_taken_llm"]),
                "identical_to_ar": None if ar_row is None or row["error"] else
                list(row["generated_tokens"]) == list(ar_row["generated_tokens"]),
                "levels": [levels[k] for k in sorted(levels)],
                "characters_kept": kept(row["generated_text"], names),
                "chunk_summaries_keep": kept(" ".join(texts.get(0, [])), names),
                "chunk_recall": chunk_recall(run.chunks.get(text, []), leaves),
                "summary": row["generated_text"]}
        if "truncate" in runs:
            row = runs["truncate"].rows[book]
            entry["truncate"] = {"error": row["error"], "summary": row["generated_text"],
                                 "characters_kept": kept(row["generated_text"], names)}
        out["books"][book] = entry
    out["draws"] = over_draws(out["books"])
    out["runs"] = {label: {"wall_s": r.wall_s, "schedule": schedule(r)}
                   for label, r in runs.items()}
    if "ar" in runs:
        out["runs"] |= {label: {**out["runs"][label],
                                "speedup": ratio(runs["ar"].wall_s, r.wall_s)}
                        for label, r in runs.items() if label != "truncate"}
    return out


def over_draws(entries: dict) -> dict:
    """Per book (its draws' rows together) and summary (each strategy's tree, ``truncate``):
    the main characters each draw's summary kept, and their mean."""
    out: dict = {}
    for row_id, entry in entries.items():
        book = out.setdefault(book_of(row_id), {})
        summaries = dict(entry["strategies"])
        if "truncate" in entry:
            summaries["truncate"] = entry["truncate"]
        for label, s in summaries.items():
            acc = book.setdefault(label, {"of": len(entry["characters"]), "kept": [],
                                          "recalls": []})
            acc["kept"].append(len(s["characters_kept"]))
            if s.get("chunk_recall") is not None:
                acc["recalls"].append(s["chunk_recall"])
    return {name: {label: {"of": acc["of"], "kept": acc["kept"],
                           "mean": sum(acc["kept"]) / len(acc["kept"]),
                           "chunk_recall": (sum(acc["recalls"]) / len(acc["recalls"])
                                            if acc["recalls"] else None)}
                   for label, acc in book.items()}
            for name, book in out.items()}


def table(result: dict) -> list[str]:
    """The report as Markdown lines."""
    lines = ["| book | strategy | wall s | generation s | generations | chunks | depth | "
             "tree speedup | identical to ar | characters kept: tree / its chunk summaries / "
             "truncated |", "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for book, entry in result["books"].items():
        names = len(entry["characters"])
        trunc = entry.get("truncate", {}).get("characters_kept", [])
        for label, s in entry["strategies"].items():
            lines.append(
                f"| {book} | {label} | {result['runs'][label]['wall_s']:.0f} | "
                f"{s['generation_s'] or 0:.0f} | {s['generations']} | {s['chunks']} | "
                f"{s['depth']} | {_fmt(s['tree_speedup'])} | {s['identical_to_ar']} | "
                f"{len(s['characters_kept'])}/{names} / {len(s['chunk_summaries_keep'])}/"
                f"{names} / {len(trunc)}/{names} |")
    lines += ["", "Tokens per level (prompt / generated) and the main characters its summaries "
              "keep together:", ""]
    for book, entry in result["books"].items():
        for label, s in entry["strategies"].items():
            levels = ", ".join(f"L{lv['level']}: {lv['nodes']} x, {lv['prompt_tokens']} / "
                               f"{lv['generated_tokens']}, keeps {lv['characters_kept']}"
                               for lv in s["levels"])
            lines.append(f"- {book}, {label}: {levels}")
    lines += ["", "Main characters kept, by draw (its own seeds) and their mean; chunk recall: "
              f"the share of each chunk's {CHUNK_NAMES} main characters its summary names, "
              "over the chunks and draws:", "",
              "| book | summary | kept, each draw | mean | chunk recall |",
              "|---|---|---|---:|---:|"]
    for book, summaries in result["draws"].items():
        for label, s in summaries.items():
            each = ", ".join(f"{k}/{s['of']}" for k in s["kept"])
            recall = "-" if s["chunk_recall"] is None else f"{s['chunk_recall']:.2f}"
            lines.append(f"| {book} | {label} | {each} | {s['mean']:.2f} | {recall} |")
    return lines


def schedule_table(result: dict) -> list[str]:
    """The short rows beside the books and the progress line's ETA, per run, as Markdown."""
    lines = ["| run | short rows | short rows done (s) | books done (s) | ETA lines checked | "
             "ETA within 1.5x | ETA off, median / most |", "|---|---:|---:|---:|---:|---:|---|"]
    for label, r in result["runs"].items():
        s, eta = r["schedule"], r["schedule"]["eta"]
        checked = ("-", "-", "-") if eta is None else (
            eta["lines"], f"{eta['within_1_5']:.0%}", f"{eta['median']:.2f}x / {eta['max']:.2f}x")
        lines.append(f"| {label} | {s['short_rows']} | {_num(s['short_rows_done_s'])} | "
                     f"{_num(s['books_done_s'])} | {checked[0]} | {checked[1]} | {checked[2]} |")
    return lines


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"
