#!/usr/bin/env python
"""Build the bundled sample data of knapspec_dist from the shared Austen corpus.

Writes

* ``knapspec_dist/data/sample_chapters.parquet``: 12 chapters, two from each of the six
  novels, of varied length (four short of 1-2k tokens, two of 2-3k, six of 3-6k,
  counted with the SmolLM2 tokenizer); columns ``id`` (``persuasion-ch03``), ``book``,
  ``chapter`` (1-based position in the book, see ``knapspec_dist.tools.corpus``) and
  ``document`` (the chapter's body);
* ``knapspec_dist/data/chapter.txt``: Pride and Prejudice, chapter 1 (about 1.2k
  tokens), the document of the first demo.

Usage::

    python scripts/build_sample.py [--corpus DIR] [--out DIR]

The corpus defaults to ``knapspec_dist.tools.corpus.shared_corpus_dir()``.  Token counts use
the embedded SmolLM2 tokenizer when it is available (converted on first use); without it
the length checks are skipped.  The output is deterministic (same input, same bytes
apart from Parquet's writer metadata).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from knapspec_dist.model.embedded import ensure_smollm2  # noqa: E402 - after the path is set
from knapspec_dist.tools.corpus import Chapter, chapters, shared_corpus_dir  # noqa: E402

logger = logging.getLogger("build_sample")

#: (book, chapter number, expected token range) in output order: short and long mixed.
SELECTION: list[tuple[str, int, tuple[int, int]]] = [
    ("persuasion", 3, (3000, 6000)),
    ("prideprejudice", 2, (1000, 2000)),
    ("emma", 13, (3000, 6000)),
    ("sensesensibility", 5, (1000, 2000)),
    ("northangerabbey", 10, (3000, 6000)),
    ("mansfieldpark", 39, (2000, 3000)),
    ("emma", 17, (1000, 2000)),
    ("prideprejudice", 47, (3000, 6000)),
    ("northangerabbey", 1, (1000, 2000)),
    ("persuasion", 4, (2000, 3000)),
    ("sensesensibility", 20, (3000, 6000)),
    ("mansfieldpark", 13, (3000, 6000)),
]
#: The first demo's document.
DEMO_CHAPTER = ("prideprejudice", 1, (900, 1500))


def _token_counter():
    try:
        tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    except Exception as exc:  # noqa: BLE001 - optional: only used for checks
        logger.warning("SmolLM2 tokenizer unavailable (%s); skipping length checks", exc)
        return None
    return lambda text: len(tok.backend_tokenizer.encode(text, add_special_tokens=False).ids)


def _get(books: dict[str, list[Chapter]], corpus: Path, book: str, number: int) -> Chapter:
    if book not in books:
        books[book] = chapters(corpus / "austen" / f"{book}.txt")
    ch = books[book][number - 1]
    assert ch.number == number, (book, number, ch.number)
    return ch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=None, help="corpus dir (holds austen/)")
    ap.add_argument("--out", type=Path, default=REPO / "knapspec_dist" / "data")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    corpus = args.corpus or shared_corpus_dir()
    if corpus is None:
        logger.error("no shared corpus found; pass --corpus or set KNAPSPEC_CORPUS")
        return 2
    count = _token_counter()
    books: dict[str, list[Chapter]] = {}
    rows = []
    for book, number, (lo, hi) in SELECTION:
        ch = _get(books, corpus, book, number)
        n = count(ch.text) if count else None
        if n is not None and not lo <= n <= hi:
            raise SystemExit(f"{ch.id}: {n} tokens, expected {lo}-{hi}")
        logger.info("%-22s %6s tokens  %7d chars", ch.id, n, len(ch.text))
        rows.append({"id": ch.id, "book": ch.book, "chapter": ch.number, "document": ch.text})
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids), "duplicate ids"

    schema = pa.schema(
        [
            ("id", pa.string()),
            ("book", pa.string()),
            ("chapter", pa.int64()),
            ("document", pa.string()),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    args.out.mkdir(parents=True, exist_ok=True)
    parquet = args.out / "sample_chapters.parquet"
    pq.write_table(table, parquet, compression="zstd", compression_level=19)

    book, number, (lo, hi) = DEMO_CHAPTER
    demo = _get(books, corpus, book, number)
    n = count(demo.text) if count else None
    if n is not None and not lo <= n <= hi:
        raise SystemExit(f"{demo.id}: {n} tokens, expected {lo}-{hi}")
    chapter_txt = args.out / "chapter.txt"
    chapter_txt.write_text(demo.text + "\n", encoding="utf-8")

    print(
        f"wrote {parquet} ({len(rows)} rows, {parquet.stat().st_size / 1024:.1f} KiB) and "
        f"{chapter_txt} ({demo.id}, {n} tokens, {chapter_txt.stat().st_size / 1024:.1f} KiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
