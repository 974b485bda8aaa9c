"""The repeated-sentence detector behind the demo's settings (scripts/check_demo_summaries.py)."""

from __future__ import annotations

from knapspec_dist.tools.repeats import repeated_sentences, words


def test_a_sentence_said_again_as_a_clause_is_found():
    """The demo's summary at temperature 0.7, top-p 0.9 with SmolLM2-135M."""
    text = ("Your story is filled with kindness, compassion, and a desire to help those who "
            "need it. I'm glad you shared it with me. It's a great way to think about your "
            "life, and I'm glad you shared it with me.")
    assert repeated_sentences(text) == ["i'm glad you shared it with me"]


def test_a_short_sentence_said_twice_is_found_and_case_and_punctuation_do_not_hide_it():
    assert repeated_sentences("Emma smiled at him. She left the room! emma smiled, at him") == [
        "emma smiled at him"]
    assert repeated_sentences("He wept.\nHe wept!") == []  # two words: below the sentence floor
    assert repeated_sentences("He wept.\nHe wept!", min_sentence_words=2) == ["he wept"]


def test_a_loop_is_one_maximal_run():
    loop = "The previous day was a very different thing from the previous day"
    text = f"{loop}, {loop}, {loop}."
    found = repeated_sentences(text)
    assert len(found) == 1 and found[0].startswith("the previous day was a very different")


def test_a_summary_without_repeats_has_none():
    text = ("Emma visits Harriet and learns of Mr. Martin's proposal. She persuades Harriet "
            "to refuse him, believing Mr. Elton admires her. Mr. Knightley is angry when he "
            "hears of it and warns Emma that Elton will never marry beneath himself.")
    assert repeated_sentences(text) == []


def test_words_keep_apostrophes_and_drop_punctuation():
    assert words("I\u2019m glad -- you shared it, with me.") == [
        "i'm", "glad", "you", "shared", "it", "with", "me"]
