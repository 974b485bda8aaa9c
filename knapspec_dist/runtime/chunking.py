"""Cut a document longer than the context window into chunks of at most N tokens, at natural
boundaries: after the last paragraph break in the chunk's second half, else after the last
sentence end there, else at a token boundary (a boundary earlier than half would leave many
small chunks: more generations, each summarizing less).

Counted in the model's own tokens (the tokenizer's offset mapping ties each token to its
characters), so a chunk's prompt fits the window it was sized for. Pure and deterministic:
the same text, tokenizer and sizes cut the same chunks, so a resumed job finds the nodes it
summarized before (runtime/tree.py keys them by a hash of their text).
"""

from __future__ import annotations

import bisect
import hashlib
import re
from dataclasses import dataclass

#: A blank line (paragraph break): a cut may fall just after it.
_PARAGRAPH = re.compile(r"\n[ \t]*\n\s*")
#: A sentence end: ., ! or ? (closing quotes or brackets after it), then white space.
_SENTENCE = re.compile(r"[.!?][\"'\u201d\u2019)\]]*\s+")


def text_digest(texts: list[str]) -> str:
    """The hash of a tree node's input (its chunk, or the summaries it combines, in order):
    what a resumed job compares before it reuses a node."""
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Chunk:
    """One piece of a document: its text and where its tokens lie in the document's."""

    index: int
    text: str
    first_token: int  # overlap included
    end_token: int  # exclusive


def cut_points(text: str, starts: list[int], pattern: re.Pattern) -> list[int]:
    """The token indices at which a cut after ``pattern``'s matches falls: the first token
    that starts at or after each match's end."""
    points = set()
    for m in pattern.finditer(text):
        i = bisect.bisect_left(starts, m.end())
        if 0 < i < len(starts):
            points.add(i)
    return sorted(points)


def _farthest(points: list[int], start: int, limit: int) -> int | None:
    """The largest point in (start, limit], or None."""
    i = bisect.bisect_right(points, limit) - 1
    return points[i] if i >= 0 and points[i] > start else None


def chunk_document(text: str, tokenizer, chunk_tokens: int, overlap: int = 0) -> list[Chunk]:
    """``text`` as chunks of at most ``chunk_tokens`` tokens (plus ``overlap`` tokens of the
    previous chunk's end, for context across a cut), in order, covering every token."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not 0 <= overlap < chunk_tokens:
        raise ValueError(f"overlap must be in [0, {chunk_tokens}), got {overlap}")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    spans = [tuple(s) for s in enc["offset_mapping"]]
    starts = [s for s, _ in spans]
    n = len(spans)
    paragraphs = cut_points(text, starts, _PARAGRAPH)
    sentences = cut_points(text, starts, _SENTENCE)
    chunks: list[Chunk] = []
    start = 0
    while start < n:
        limit = start + chunk_tokens
        floor = start + (chunk_tokens + 1) // 2 - 1  # a boundary leaves it half full at least
        if limit >= n:
            end = n
        else:
            end = (_farthest(paragraphs, floor, limit) or _farthest(sentences, floor, limit)
                   or limit)
        first = max(0, start - overlap) if chunks else 0
        piece = text[spans[first][0]:spans[end - 1][1]].strip()
        if piece:  # white space alone (a document's tail) is nothing to summarize
            chunks.append(Chunk(len(chunks), piece, first, end))
        start = end
    return chunks
