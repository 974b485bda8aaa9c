"""A tree's options checked with each other and with the model before anything runs, for the
command line, ``run_job`` and the processor alike: a shape that no long row could take is one
``UserError`` line naming the options and their values (exit 2 from the command line), and
nothing is written (fakes for the job; the embedded SmolLM2's tokenizer, no Ray, for the
command line and the processor)."""

from __future__ import annotations

import sys

import pytest

from knapspec_dist.cli.job import main as summarize_main
from knapspec_dist.cli.main import main as knapspec_main
from knapspec_dist.errors import UserError
from knapspec_dist.runtime.processor import ProcessorConfig, build_processor
from knapspec_dist.runtime.prompts import (
    CHUNK_SLACK,
    DEFAULT_CHUNK_TOKENS,
    TreeShape,
    tree_chunk_tokens,
)
from knapspec_dist.runtime.tree import SEPARATOR

from fakes import FakeEngines, docs_of, job, read_rows, run, write_input

# A chunk's and a group's prompt template, in tokens, for the pure function's cases.
CHUNK_T, COMBINE_T = 60, 50


def refused(tree: TreeShape, max_model_len: int, max_new_tokens: int, *needles: str) -> str:
    """The one-line refusal of ``tree`` in that window, holding every needle."""
    with pytest.raises(UserError) as e:
        tree_chunk_tokens(tree, max_model_len, max_new_tokens, CHUNK_T, COMBINE_T)
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# ----------------------------------------------------------------------------- the pure rule


def test_the_chunk_is_the_given_one_or_the_default_or_half_of_a_small_window():
    assert tree_chunk_tokens(TreeShape(), 8192, 128, CHUNK_T, COMBINE_T) == DEFAULT_CHUNK_TOKENS
    text = 1000 - 128 - CHUNK_T - CHUNK_SLACK
    assert tree_chunk_tokens(TreeShape(), 1000, 128, CHUNK_T, COMBINE_T) == text // 2
    assert tree_chunk_tokens(TreeShape(overlap=100), 1000, 128, CHUNK_T,
                             COMBINE_T) == (text - 100) // 2
    assert tree_chunk_tokens(TreeShape(chunk_tokens=5000), 8192, 128, CHUNK_T,
                             COMBINE_T) == 5000


def test_an_overlap_not_shorter_than_the_chunk_is_refused_given_or_default():
    refused(TreeShape(chunk_tokens=512, overlap=512), 8192, 128,
            "--chunk-overlap 512", "--chunk-tokens 512")
    refused(TreeShape(overlap=3000), 8192, 128, "--chunk-overlap 3000", "2048")
    # a small window's default chunk is half of what the overlap leaves: 300 is not less
    text = 600 - 128 - CHUNK_T - CHUNK_SLACK
    refused(TreeShape(overlap=300), 600, 128, "--chunk-overlap 300",
            f"default --chunk-tokens is {(text - 300) // 2} here", "--max-model-len 600",
            "--max-new-tokens 128")
    assert tree_chunk_tokens(TreeShape(overlap=100), 600, 128, CHUNK_T, COMBINE_T) > 100


def test_a_chunk_past_what_its_prompt_holds_is_refused_at_its_bound():
    room = 8192 - 128 - CHUNK_T - CHUNK_SLACK - 16
    shape = TreeShape(chunk_tokens=room, overlap=16)
    assert tree_chunk_tokens(shape, 8192, 128, CHUNK_T, COMBINE_T) == room
    refused(TreeShape(chunk_tokens=room + 1, overlap=16), 8192, 128,
            f"--chunk-tokens {room + 1} + --chunk-overlap 16", "--max-model-len 8192",
            "--max-new-tokens 128", f"--chunk-tokens {room} at most")
    refused(TreeShape(chunk_tokens=100_000), 8192, 128, "--chunk-tokens 100000")


def test_a_window_that_cannot_combine_two_summaries_is_refused_at_its_bound():
    """A tree's level combines two summaries at least; two of --max-new-tokens each and the
    combining template must fit, or every tree of more than one chunk would fail."""
    new = 100
    fits = COMBINE_T + 2 * (new + SEPARATOR) + new  # the window: prompt + the new tokens
    assert tree_chunk_tokens(TreeShape(), fits, new, 10, COMBINE_T) >= 1
    refused(TreeShape(), fits - 1, new, f"--max-new-tokens {new}",
            f"--max-model-len {fits - 1}", "--long-documents truncate or fail")


def test_a_window_whose_chunk_prompt_holds_no_text_is_refused():
    """A chunk instruction longer than the window leaves no default chunk (a given one is
    refused by the bound above)."""
    template = 260 - 20 - CHUNK_SLACK  # the template and slack take every prompt token
    with pytest.raises(UserError, match=r"a chunk's prompt holds no text: --max-model-len 260 "
                                        r"- --max-new-tokens 20 leaves 240"):
        tree_chunk_tokens(TreeShape(), 260, 20, template, COMBINE_T)
    assert tree_chunk_tokens(TreeShape(), 260, 20, template - 2, COMBINE_T) == 1


# ----------------------------------------------------------------------------- the job


def test_job_and_processor_configs_refuse_what_needs_no_model(tmp_path):
    with pytest.raises(UserError, match="--chunk-overlap 3000 .*2048"):
        job(tmp_path, chunk_overlap=3000)
    with pytest.raises(UserError, match="--chunk-overlap 512 must be less than --chunk-tokens "
                                        "512"):
        job(tmp_path, chunk_tokens=512, chunk_overlap=512)
    with pytest.raises(UserError, match="--chunk-overlap 100 must be less than --chunk-tokens "
                                        "100"):
        ProcessorConfig(document_column="text", tree=TreeShape(chunk_tokens=100, overlap=100))
    with pytest.raises(UserError, match="--chunk-overlap 3000"):
        ProcessorConfig(document_column="text", tree=TreeShape(overlap=3000))


def test_a_job_refuses_a_chunk_its_window_cannot_hold_before_any_engine(tmp_path):
    write_input(tmp_path / "in.parquet", ["a", "b"], docs_of([10, 400]))
    engines = FakeEngines()
    with pytest.raises(UserError, match=r"--chunk-tokens 100000 \+ --chunk-overlap 0 do not "
                                        r"fit .*--max-model-len 64 - --max-new-tokens 6"):
        run(job(tmp_path, chunk_tokens=100_000), engines)
    assert engines.created == [] and not (tmp_path / "out").exists()


def test_the_default_tree_is_checked_too_and_a_job_without_trees_is_not(tmp_path):
    """Defaults included: a window that leaves no room to combine two summaries refuses the
    summarization job's default tree even with no long row; without trees it runs."""
    write_input(tmp_path / "in.parquet", ["a"], docs_of([3]))
    engines = FakeEngines()
    with pytest.raises(UserError, match="--max-new-tokens 6: a tree combines"):
        run(job(tmp_path), engines, window=40)
    assert engines.created == [] and not (tmp_path / "out").exists()
    result, _ = run(job(tmp_path, long_documents="fail"), window=40)
    assert [r["error"] for r in read_rows(result.output)] == [None]


# ----------------------------------------------------------------------------- command line

CASES = {
    "overlap past the default chunk": (["--chunk-overlap", "3000"],
                                       ["--chunk-overlap 3000", "2048"]),
    "overlap as long as the chunk": (["--chunk-tokens", "512", "--chunk-overlap", "512"],
                                     ["--chunk-overlap 512", "--chunk-tokens 512"]),
    "chunk past the window": (["--chunk-tokens", "100000"],
                              ["--chunk-tokens 100000", "--max-model-len 8192",
                               "--max-new-tokens 128"]),
    "no room for two summaries": (["--max-model-len", "300"],
                                  ["--max-new-tokens 128", "--max-model-len 300"]),
}


def one_error_line(capsys, rc: int, needles: list[str]) -> None:
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2, err
    assert "Traceback" not in err and len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "refused only after Ray started"


@pytest.mark.parametrize("case", sorted(CASES))
def test_knapspec_job_refuses_with_one_line_exit_2_and_writes_nothing(tmp_path, capsys, case):
    options, needles = CASES[case]
    inp = write_input(tmp_path / "in.parquet", ["a"], ["A short document."])
    out = tmp_path / "out"
    rc = knapspec_main(["job", "--input", inp, "--output", str(out), "--model", "smollm2",
                        "--strategy", "ar", *options])
    one_error_line(capsys, rc, needles)
    assert not out.exists()


def test_summarize_py_refuses_the_same_way(tmp_path, capsys):
    inp = write_input(tmp_path / "in.parquet", ["a"], ["A short document."])
    out = tmp_path / "out"
    out.mkdir()  # an existing empty folder stays empty
    options, needles = CASES["chunk past the window"]
    rc = summarize_main(["--input", inp, "--output", str(out), "--strategy", "ar", *options])
    one_error_line(capsys, rc, needles)
    assert list(out.iterdir()) == []


def test_the_processor_refuses_when_built_before_ray():
    with pytest.raises(UserError, match=r"--chunk-tokens 100000 .*--max-model-len 8192"):
        build_processor(ProcessorConfig(strategy="ar", document_column="text",
                                        tree=TreeShape(chunk_tokens=100_000)))
    with pytest.raises(UserError, match="--max-new-tokens 8: a tree combines"):
        build_processor(ProcessorConfig(strategy="ar", document_column="text",
                                        max_model_len=40, sampling={"max_new_tokens": 8}))
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()
    assert callable(build_processor(ProcessorConfig(strategy="ar", document_column="text",
                                                    tree=TreeShape(chunk_tokens=4000))))
