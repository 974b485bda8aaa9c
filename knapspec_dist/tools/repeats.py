"""Repeated sentences in generated text: what makes a small model's summary read as a loop
(``make demo``'s check of its settings, scripts/check_demo_summaries.py).

Two kinds are reported, both after lower-casing and dropping punctuation:

- a sentence (ended by ``.``, ``!``, ``?`` or a line break) of at least ``min_sentence_words``
  words said twice;
- a run of ``min_run_words`` words said twice anywhere, which catches a sentence repeated as a
  clause of another ("I'm glad you shared it with me. ... life, and I'm glad you shared it
  with me.") and a loop that never ends its sentence.
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def words(text: str) -> list[str]:
    """Lower-cased words, punctuation dropped (apostrophes inside a word kept)."""
    return _WORD.findall(text.lower().replace("\u2019", "'"))


def repeated_sentences(text: str, min_sentence_words: int = 3, min_run_words: int = 6
                       ) -> list[str]:
    """The sentences and word runs said more than once in ``text``, each once, longest run
    first (a run inside a longer repeated run is not listed again)."""
    found: list[str] = []
    seen: set[tuple[str, ...]] = set()
    for sentence in _SENTENCE_END.split(text):
        key = tuple(words(sentence))
        if len(key) < min_sentence_words:
            continue
        if key in seen and " ".join(key) not in found:
            found.append(" ".join(key))
        seen.add(key)
    ws = words(text)
    starts: dict[tuple[str, ...], int] = {}
    repeated: set[int] = set()  # start indices of a run that occurred before
    for i in range(len(ws) - min_run_words + 1):
        gram = tuple(ws[i:i + min_run_words])
        if gram in starts and starts[gram] + min_run_words <= i:  # not overlapping itself
            repeated.add(i)
        starts.setdefault(gram, i)
    i = 0
    while i < len(ws):  # join consecutive repeated starts into maximal runs
        if i not in repeated:
            i += 1
            continue
        j = i
        while j + 1 in repeated:
            j += 1
        run = " ".join(ws[i:j + min_run_words])
        if not any(run in f for f in found):
            found.append(run)
        i = j + 1
    return found
