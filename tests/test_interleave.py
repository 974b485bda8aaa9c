"""The run order of interleaved repeats."""

from knapspec_dist.tools.interleave import interleaved


def test_each_repeat_runs_every_item_once_starting_one_later():
    order = interleaved(["a", "b", "c"], 4)
    assert [item for _, item in order] == list("abc" "bca" "cab" "abc")
    assert [rep for rep, _ in order] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3


def test_two_items_alternate_which_runs_first():
    assert [m for _, m in interleaved(["fixed", "paged"], 3)] == [
        "fixed", "paged", "paged", "fixed", "fixed", "paged"]
