"""The books benchmark's own arithmetic: main characters, what a summary keeps, the report
(its runs are real jobs: `knapspec books`, not part of make test)."""

from __future__ import annotations

from pathlib import Path

from knapspec_dist.tools.books import (
    Run,
    book_of,
    chunk_recall,
    draw_id,
    eta_accuracy,
    kept,
    main_characters,
    report,
    schedule,
    short_texts,
    table,
)


def test_main_characters_are_frequent_capitalized_words_seldom_lower_case():
    text = ("Anne walked. Anne said so. Then Wentworth came; Wentworth and Anne spoke. "
            "Mr Elliot left. Bath was wet. Then the rain. Walter sat.") * 3 + " then then then"
    assert main_characters(text, k=3) == ["Anne", "Wentworth", "Elliot"]  # Then: lower too
    assert kept("Anne met Wentworth's friend.", ["Anne", "Wentworth", "Elliot"]) == [
        "Anne", "Wentworth"]
    assert kept(None, ["Anne"]) == []


def row(text, seconds, tokens, error=None, path="tree"):
    return {"error": error, "document_path": path, "tree_chunks": 3, "tree_depth": 2,
            "tree_generations": 4, "time_taken_llm": seconds, "generated_tokens": tokens,
            "generated_text": text}


def nodes(book):
    return [{"id": book, "level": lv, "index": i, "num_input_tokens": 100,
             "num_generated_tokens": 10, "generated_text": text}
            for lv, i, text in ((0, 0, "Anne"), (0, 1, "x"), (0, 2, "Wentworth"), (1, 0, "y"))]


def test_the_report_gives_levels_speedup_identity_and_characters_kept():
    books = {"b": "Anne and Anne and Anne. Wentworth, Wentworth."}
    chunks = {books["b"]: ["Anne and Anne.", "Isabella, Isabella.", "Wentworth, Wentworth."]}
    runs = {"ar": Run("ar", Path("."), 100.0, {"b": row("Anne and Wentworth.", 80.0, [1, 2])},
                      nodes("b"), chunks),
            "knapspec": Run("knapspec", Path("."), 80.0,
                            {"b": row("Anne and Wentworth.", 50.0, [1, 2])}, nodes("b")),
            "truncate": Run("truncate", Path("."), 10.0,
                            {"b": row("Anne.", 5.0, [1], path="truncated")}, [])}
    result = report(books, runs)
    s = result["books"]["b"]["strategies"]["knapspec"]
    assert s["tree_speedup"] == 80.0 / 50.0 and s["identical_to_ar"]
    assert s["levels"] == [{"level": 0, "nodes": 3, "prompt_tokens": 300, "generated_tokens": 30,
                            "characters_kept": 2},
                           {"level": 1, "nodes": 1, "prompt_tokens": 100, "generated_tokens": 10,
                            "characters_kept": 0}]
    assert s["characters_kept"] == s["chunk_summaries_keep"] == ["Anne", "Wentworth"]
    assert result["books"]["b"]["strategies"]["ar"]["chunk_recall"] == 2 / 3  # "x": Isabella?
    assert s["chunk_recall"] is None  # its chunks not given
    assert result["books"]["b"]["truncate"]["characters_kept"] == ["Anne"]
    assert result["runs"]["knapspec"]["speedup"] == 100.0 / 80.0
    lines = table(result)
    assert "| b | knapspec | 80 | 50 | 4 | 3 | 2 | 1.60x | True | 2/2 / 2/2 / 1/2 |" in lines


def test_draws_of_a_book_are_rows_of_their_own_read_together():
    """Three copies of a book (ids of their own: seeds of their own) give one line a summary
    with what each draw's summary kept and the mean."""
    assert [draw_id("b", d) for d in range(3)] == ["b", "b~1", "b~2"]
    assert {book_of(draw_id("b", d)) for d in range(3)} == {"b"}
    text = "Anne and Anne and Anne. Wentworth, Wentworth."
    ids = [draw_id("b", d) for d in range(3)]
    summaries = {"b": "Anne and Wentworth.", "b~1": "Anne.", "b~2": "Nobody."}
    runs = {"ar": Run("ar", Path("."), 100.0,
                      {i: row(summaries[i], 80.0, [1]) for i in ids},
                      [n | {"id": i} for i in ids for n in nodes("b")]),
            "truncate": Run("truncate", Path("."), 10.0,
                            {i: row("Wentworth.", 5.0, [1], path="truncated") for i in ids}, [])}
    result = report({i: text for i in ids}, runs)
    assert result["draws"] == {
        "b": {"ar": {"of": 2, "kept": [2, 1, 0], "mean": 1.0, "chunk_recall": None},
              "truncate": {"of": 2, "kept": [1, 1, 1], "mean": 1.0, "chunk_recall": None}}}
    assert "| b | ar | 2/2, 1/2, 0/2 | 1.00 | - |" in table(result)


def test_chunk_recall_is_the_mean_share_of_each_chunks_own_names_its_summary_keeps():
    chunks = ["Anne met Anne. Wentworth saw Wentworth.",  # names: Anne, Wentworth
              "Elliot, Elliot and Elliot.",  # Elliot
              "nobody at all here."]  # no names: not counted
    summaries = {0: "Anne left.", 1: "Elliot stayed.", 2: "Nothing."}
    assert chunk_recall(chunks, summaries) == (1 / 2 + 1) / 2
    assert chunk_recall(chunks, {0: None}) == 0.0  # a summary that failed keeps nothing
    assert chunk_recall([], {}) is None


def test_the_etas_shown_are_read_against_the_time_the_pass_then_had_left():
    """Lines every 10 s of a 100 s pass; the ETA says 1.2x the time left, but 3x at 60 s."""
    lines = [(1000.0, "books: ar")]
    for t in range(0, 101, 10):
        eta = "?" if t == 0 else f"{round(3 * (100 - t) if t == 60 else 1.2 * (100 - t))}s"
        lines.append((1000.0 + t, f"rows: 0/21 rows (0 failed), 5 tokens, 1.0 tok/s, "
                                  f"elapsed {t}s, ETA {eta}; KV cache 1 tokens"))
    got = eta_accuracy(lines)
    assert got["lines"] == 9 and got["pass_s"] == 100.0  # 10 s .. 90 s: a tenth to 95 %
    assert got["max"] == 3.0 and abs(got["median"] - 1.2) < 0.01
    assert abs(got["within_1_5"] - 8 / 9) < 1e-9
    assert eta_accuracy(lines[:3]) is None


def test_short_rows_are_paragraphs_of_the_asked_length_and_their_ends_are_reported():
    text = "\n\n".join(["too short"] + [" ".join(["word"] * 80)] * 3)
    assert list(short_texts(text, 2)) == ["short-0", "short-1"]
    timestamp = type("T", (), {"timestamp": lambda self: 1030.0})
    done = Run("ar", Path("."), 50.0, {"short-0": {"finished_at": timestamp()},
                                       "book": {"finished_at": None}}, [], started=1000.0)
    assert schedule(done) == {"short_rows": 1, "short_rows_done_s": 30.0, "books_done_s": None,
                              "eta": None}
