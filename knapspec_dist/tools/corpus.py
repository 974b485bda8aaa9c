"""Public-domain documents for prompts, tests and benchmarks.

Two sources:

* the **shared corpus**: Jane Austen's six novels as plain text, one file per book
  (``<corpus>/austen/<book>.txt``, e.g. ``persuasion.txt``), found by
  :func:`shared_corpus_dir`.  Chapters start at lines ``Chapter N`` / ``CHAPTER N``
  (arabic or roman numerals; *Emma* restarts its numbering in each volume);
* the **bundled sample** shipped inside the package: ``data/sample_chapters.parquet``
  (12 chapters of varied length from the six books; columns ``id``, ``book``,
  ``chapter``, ``document``; built by ``scripts/build_sample.py``) and
  ``data/chapter.txt`` (one short chapter used by the first demo).

Chapter numbers are the 1-based position of the chapter in its book, counted straight
through volumes, so ``emma`` chapter 19 is "VOLUME II, CHAPTER I"; the original heading
is kept in :attr:`Chapter.heading`.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pyarrow.parquet as pq
from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "AUSTEN_BOOKS",
    "Chapter",
    "bundled_chapter_path",
    "bundled_chapters",
    "bundled_sample_path",
    "book_path",
    "chapters",
    "document_of_tokens",
    "row_documents",
    "shared_corpus_dir",
    "split_chapters",
]

#: File stems of the novels in ``<corpus>/austen``.
AUSTEN_BOOKS = (
    "emma",
    "mansfieldpark",
    "northangerabbey",
    "persuasion",
    "prideprejudice",
    "sensesensibility",
)

_DATA = Path(__file__).resolve().parents[1] / "data"
_CHAPTER_RE = re.compile(r"^[ \t]*chapter[ \t]+([0-9]+|[ivxlc]+)\.?[ \t]*$", re.I | re.M)
_VOLUME_RE = re.compile(r"^[ \t]*volume[ \t]+([0-9]+|[ivxlc]+)\.?[ \t]*$", re.I)
_END_RE = re.compile(r"^[ \t]*(the end|finis)\.?[ \t]*$", re.I)
#: Editorial back matter after the last chapter (Northanger Abbey's edition note).
_BACKMATTER_RE = re.compile(r"^[ \t]*A NOTE ON THE TEXT[ \t]*$", re.M)
#: Between two chapters of a multi-chapter document.
_SEPARATOR = "\n\n\n"


@dataclass(frozen=True)
class Chapter:
    """One chapter of a book.

    Attributes:
        book: the book's file stem, e.g. ``"persuasion"``.
        number: 1-based position of the chapter in the book (through volumes).
        text: the chapter's body, without its heading, stripped of blank edges.
        heading: the heading as printed, e.g. ``"CHAPTER XIV"`` or
            ``"VOLUME II\\nCHAPTER I"`` for the first chapter of a volume.
    """

    book: str
    number: int
    text: str
    heading: str = ""

    @property
    def id(self) -> str:
        """Stable identifier, e.g. ``"persuasion-ch03"``."""
        return f"{self.book}-ch{self.number:02d}"

    def as_document(self, with_heading: bool = True) -> str:
        """The chapter as a document: heading (if any), blank line, body."""
        if with_heading and self.heading:
            return f"{self.heading}\n\n{self.text}"
        return self.text


def split_chapters(text: str, book: str) -> list[Chapter]:
    """Split the text of a novel into chapters.

    Text before the first chapter heading (title page, preface) is dropped, as are
    ``VOLUME N`` lines between chapters, a closing ``THE END`` / ``Finis`` line and
    editorial back matter starting at a line ``A NOTE ON THE TEXT``.
    A text without any chapter heading yields an empty list.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    matches = list(_CHAPTER_RE.finditer(text))
    out: list[Chapter] = []
    pending_volume = ""
    for i, m in enumerate(matches):
        if i + 1 < len(matches):
            end = matches[i + 1].start()
        else:
            back = _BACKMATTER_RE.search(text, m.end())
            end = back.start() if back else len(text)
        lines = text[m.end() : end].strip("\n").split("\n")
        # A "VOLUME N" line right before the next heading belongs to the next chapter.
        next_volume = ""
        while lines and not lines[-1].strip():
            lines.pop()
        if lines and _VOLUME_RE.match(lines[-1]):
            next_volume = lines.pop().strip()
        while lines and not lines[-1].strip():
            lines.pop()
        if i + 1 == len(matches) and lines and _END_RE.match(lines[-1]):
            lines.pop()
        body = "\n".join(lines).strip()
        heading = m.group(0).strip()
        if pending_volume:
            heading = f"{pending_volume}\n{heading}"
        out.append(Chapter(book=book, number=i + 1, text=body, heading=heading))
        pending_volume = next_volume
    # A "VOLUME I" line before the first chapter.
    if matches:
        before = text[: matches[0].start()].rstrip("\n").split("\n")
        if before and _VOLUME_RE.match(before[-1]) and out:
            first = out[0]
            out[0] = Chapter(
                first.book, first.number, first.text, f"{before[-1].strip()}\n{first.heading}"
            )
    return out


def chapters(path: str | os.PathLike[str]) -> list[Chapter]:
    """Chapters of the novel in the text file ``path``; the book is the file stem."""
    p = Path(path)
    return split_chapters(p.read_text(encoding="utf-8"), book=p.stem)


def shared_corpus_dir() -> Path | None:
    """The shared corpus directory, or ``None`` where there is none.

    ``$KNAPSPEC_CORPUS`` if set (it must then be an existing directory), else a
    ``shared/corpus`` folder beside the checkout if there is one, else ``None`` (callers then
    use the bundled sample; docs/corpus.md).

    Raises:
        FileNotFoundError: ``$KNAPSPEC_CORPUS`` names something that is not a directory.
    """
    env = os.environ.get("KNAPSPEC_CORPUS")
    if env:
        p = Path(env).expanduser()
        if not p.is_dir():
            raise FileNotFoundError(f"KNAPSPEC_CORPUS={env!r} is not a directory")
        return p
    repo = Path(__file__).resolve().parents[2]
    p = repo.parent / "shared" / "corpus"
    return p if p.is_dir() else None


def book_path(book: str, corpus: str | os.PathLike[str] | None = None) -> Path | None:
    """Path of ``<corpus>/austen/<book>.txt``, or ``None`` when it does not exist."""
    root = Path(corpus) if corpus is not None else shared_corpus_dir()
    if root is None:
        return None
    for p in (root / "austen" / f"{book}.txt", root / f"{book}.txt"):
        if p.is_file():
            return p
    return None


def bundled_sample_path() -> Path:
    """Path of the bundled ``sample_chapters.parquet`` (id, book, chapter, document)."""
    return _DATA / "sample_chapters.parquet"


def bundled_chapter_path() -> Path:
    """Path of the bundled ``chapter.txt``: one short chapter (about 1k tokens)."""
    return _DATA / "chapter.txt"


def bundled_chapters() -> list[Chapter]:
    """The chapters of the bundled sample, in file order (headings not stored)."""
    table = pq.read_table(bundled_sample_path(), columns=["book", "chapter", "document"])
    rows = table.to_pylist()
    return [Chapter(book=r["book"], number=int(r["chapter"]), text=r["document"]) for r in rows]


def document_of_tokens(
    tokenizer: Any,
    n_tokens: int,
    book: str = "prideprejudice",
    start_chapter: int = 0,
) -> str:
    """A document of about ``n_tokens`` tokens made of consecutive chapters.

    Chapters of ``book`` from index ``start_chapter`` (0-based, into :func:`chapters`)
    on are joined (heading, blank line, body; chapters separated by blank lines) and
    the text is cut right after the ``n_tokens``-th token.  Re-encoding the result
    gives ``n_tokens`` tokens, give or take one or two where BPE merges differently
    at the cut.  Special tokens are not counted (the chat template adds its own).

    ``tokenizer`` is a Hugging Face tokenizer (fast ones are cut by character
    offsets, others by decoding the kept ids) or a ``tokenizers.Tokenizer``.

    Sources and fallbacks:

    * the shared corpus (:func:`shared_corpus_dir`) when there is one (a ``book`` it
      lacks is a ``ValueError``); when the book runs out, it continues from its first
      chapter again (repeats);
    * where there is no shared corpus, the bundled sample: its chapters of ``book``
      (sorted by chapter number) if it has any, else all of
      its chapters in file order, starting at ``start_chapter`` modulo their count and
      repeated cyclically as often as needed.  A warning is logged, since such a
      document is not a contiguous piece of the book.
    """
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be positive, got {n_tokens}")
    if start_chapter < 0:
        raise ValueError(f"start_chapter must be >= 0, got {start_chapter}")
    pool, start_chapter, origin = _chapter_pool(book, start_chapter, n_tokens)
    text = _collect(tokenizer, pool, start_chapter, n_tokens, origin)
    ids, offsets = _encode(tokenizer, text)
    if len(ids) <= n_tokens:  # pragma: no cover - the collected margin makes this rare
        return text
    if offsets is not None:
        return text[: offsets[n_tokens - 1][1]]
    return _decode(tokenizer, ids[:n_tokens])


def _chapter_pool(book: str, start_chapter: int, n_tokens: int) -> tuple[list[Chapter], int, str]:
    """The chapters a document is cut from, the index to start at, and their origin (for
    messages): the shared corpus's book, else the bundled sample (with a warning)."""
    corpus = shared_corpus_dir()
    path = book_path(book, corpus) if corpus is not None else None
    if corpus is not None and path is None:
        raise ValueError(f"no book {book!r} in the corpus at {corpus} (have {AUSTEN_BOOKS})")
    if path is not None:
        pool = chapters(path)
        if start_chapter >= len(pool):
            raise ValueError(f"{book} has {len(pool)} chapters; start_chapter={start_chapter}")
        origin = str(path)
    else:
        sample = bundled_chapters()
        pool = sorted((c for c in sample if c.book == book), key=lambda c: c.number)
        pool = pool or sample
        origin = f"bundled sample {bundled_sample_path().name}"
        logger.warning(
            "shared corpus with %r not found; building a %d-token document from the %s "
            "(%s chapters, repeated if needed)",
            book,
            n_tokens,
            origin,
            "its " + book if pool is not sample else "all",
        )
        start_chapter %= len(pool)
    return pool, start_chapter, origin


def _collect(tokenizer: Any, pool: list[Chapter], start_chapter: int, n_tokens: int,
             origin: str) -> str:
    """Consecutive chapters of ``pool`` from ``start_chapter`` on (cyclically), joined, until
    they hold ``n_tokens`` tokens plus a margin: chapter-wise counts are nearly additive, so
    the caller can then cut exactly."""
    parts: list[str] = []
    counted = 0
    i = start_chapter
    while counted < n_tokens + 64:
        ch = pool[i % len(pool)]
        doc = Chapter(ch.book, ch.number, ch.text, ch.heading or f"Chapter {ch.number}")
        piece = doc.as_document()
        parts.append(piece)
        counted += len(_encode(tokenizer, piece)[0]) + 2
        i += 1
        if i - start_chapter > 100_000:  # pragma: no cover - empty chapters only
            raise RuntimeError(f"could not collect {n_tokens} tokens from {origin}")
    if i - start_chapter > len(pool):
        logger.info("document of %d tokens repeats chapters of %s", n_tokens, origin)
    return _SEPARATOR.join(parts)


def _backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind a fast tokenizer (or the object itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def _encode(tokenizer: Any, text: str) -> tuple[Sequence[int], list[tuple[int, int]] | None]:
    """Token ids without special tokens, plus character offsets where available."""
    backend = _backend(tokenizer)
    if backend is not None:
        # Straight to the Rust tokenizer: offsets for free, and no "sequence longer
        # than model_max_length" warning for long documents.
        enc = backend.encode(text, add_special_tokens=False)
        return enc.ids, list(enc.offsets)
    return list(tokenizer.encode(text, add_special_tokens=False)), None


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids))


def row_documents(tokenizer: Any, count: int, n_tokens: int) -> list[str]:
    """``count`` documents of about ``n_tokens`` tokens, no two alike, for the rows of one
    batch: document ``j`` is :func:`document_of_tokens` of book ``j`` (in
    :data:`AUSTEN_BOOKS` order, cyclically) from chapter ``3 * (j // 6)`` on."""
    return [document_of_tokens(tokenizer, n_tokens, AUSTEN_BOOKS[j % len(AUSTEN_BOOKS)],
                               3 * (j // len(AUSTEN_BOOKS))) for j in range(count)]
