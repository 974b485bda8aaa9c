"""Documents past the window: chunking at natural boundaries, the tree's greedy packing and
its rules, and a job that summarizes them through trees, resumed node by node (fakes: no
model, no Ray)."""

from __future__ import annotations

import logging
import random
from dataclasses import replace

import pytest

from knapspec_dist.engine.generation import GenerationConfig, GenerationResult, GenerationStats
from knapspec_dist.errors import UserError
from knapspec_dist.jobs import JobConfig, run_job
from knapspec_dist.runtime.chunking import chunk_document, text_digest
from knapspec_dist.runtime.dispatch import Dispatcher, Task
from knapspec_dist.runtime.prompts import DEFAULT_CHUNK_TOKENS, PromptBuilder, TreeShape
from knapspec_dist.runtime.tree import DocumentTree, StoredNode
from knapspec_dist.speculation.options import StrategyOptions

from fakes import (
    FakeBackend,
    FakeEngines,
    docs_of,
    fake_tools,
    job,
    read_rows,
    run,
    write_input,
)


def tokenizer():
    tok, _ = fake_tools()(None)
    return tok


def words(chunk) -> list[str]:
    return chunk.text.split()


# ---------------------------------------------------------------- chunking


def test_chunks_end_at_a_paragraph_break_else_a_sentence_else_at_the_limit():
    para = "a1 a2 a3.\n\nb1 b2 b3 b4. b5 b6 b7 b8 b9 b10 b11 b12 b13 b14 b15 b16 b17\n\nc1 c2"
    chunks = chunk_document(para, tokenizer(), chunk_tokens=6)
    # the paragraph break after a3 (3 of 6: half full), then the sentence end after b4, then
    # no boundary within 6 words: cut at the limit; the last chunk is the rest
    assert [words(c) for c in chunks] == [
        ["a1", "a2", "a3."], ["b1", "b2", "b3", "b4."], ["b5", "b6", "b7", "b8", "b9", "b10"],
        ["b11", "b12", "b13", "b14", "b15", "b16"], ["b17", "c1", "c2"]]
    # every token once, in order; the same cut every time
    assert sum((words(c) for c in chunks), []) == para.split()
    assert chunk_document(para, tokenizer(), 6) == chunks


def test_a_boundary_in_a_chunks_first_half_is_passed_over():
    text = "x1. x2.\n\nx3 x4. x5 x6 x7 x8 x9"
    chunks = chunk_document(text, tokenizer(), chunk_tokens=5)
    # the paragraph break after 2 of 5 words is too early: the sentence end after x4 wins
    assert [words(c) for c in chunks] == [["x1.", "x2.", "x3", "x4."],
                                          ["x5", "x6", "x7", "x8", "x9"]]


def test_an_overlap_repeats_the_end_of_the_previous_chunk():
    text = " ".join(f"w{i}" for i in range(20))
    chunks = chunk_document(text, tokenizer(), chunk_tokens=8, overlap=3)
    assert [words(c)[0] for c in chunks] == ["w0", "w5", "w13"]
    assert [(c.first_token, c.end_token) for c in chunks] == [(0, 8), (5, 16), (13, 20)]
    with pytest.raises(ValueError, match="overlap"):
        chunk_document(text, tokenizer(), chunk_tokens=3, overlap=3)


def test_a_long_document_row_carries_its_chunks_prompts_instead_of_one_prompt():
    tok = tokenizer()
    shape = TreeShape(chunk_instruction="Part {part} of {parts}:")
    b = PromptBuilder(tok, "text", "Sum:", 60, 4, False, "document", shape)
    # limit 56; a chunk prompt's template: 4 + 4 instruction words + 8 slack -> 40 / 2
    assert b.chunk_tokens == 20
    doc = docs_of([60])[0]
    p = b.build(0, "a", doc)
    assert p.ids is None and p.error is None and p.num_input_tokens == 60 + 5
    assert [len(ids) for ids, _ in p.chunks] == [4 + 4 + 20] * 3
    assert p.chunks[0][1] == text_digest([" ".join(doc.split()[:20])])
    assert b.build(1, "b", docs_of([10])[0]).ids is not None  # one that fits: one prompt
    prompt = PromptBuilder(tok, "prompt", "", 20, 4, False, "prompt", TreeShape())
    assert prompt.build(0, "c", doc).error.startswith("prompt has 61 tokens")  # no tree
    with pytest.raises(UserError, match="--max-model-len 20 - --max-new-tokens 4"):
        PromptBuilder(tok, "text", "Sum:", 20, 4, False, "document", shape)  # no tree fits


def test_the_default_chunk_is_capped_whatever_the_window():
    """Half of what a large window leaves would squeeze thousands more tokens into one
    summary: the default stops at DEFAULT_CHUNK_TOKENS; a small window keeps its half."""
    tok, shape = tokenizer(), TreeShape(chunk_instruction="Part {part} of {parts}:")
    assert PromptBuilder(tok, "text", "Sum:", 100_000, 4, False, "document",
                         shape).chunk_tokens == DEFAULT_CHUNK_TOKENS
    assert PromptBuilder(tok, "text", "Sum:", 4_000, 4, False, "document",
                         shape).chunk_tokens == (4_000 - 4 - 16) // 2
    assert PromptBuilder(tok, "text", "Sum:", 100_000, 4, False, "document",
                         replace(shape, chunk_tokens=5_000)).chunk_tokens == 5_000


# ---------------------------------------------------------------- the tree


def result(text: str, n: int = 3) -> GenerationResult:
    return GenerationResult(list(range(n)), GenerationStats(prompt_tokens=10, new_tokens=n,
                                                            wall_s=1.0), "length", text)


def combine(summaries, level, index):
    """A made-up combining prompt: 4 template tokens and each summary's 3 + 2."""
    return [0] * (4 + 5 * len(summaries))


def grow(n_chunks: int, limit: int, order: random.Random | None = None, max_depth: int = 8,
         known=None, max_fan_in: int | None = None) -> tuple[DocumentTree, list]:
    tree = DocumentTree("doc", [([1], f"d{i}") for i in range(n_chunks)], combine, limit,
                        max_depth, known or {}, max_fan_in)
    ran = []
    pending = tree.ready()
    while pending and not tree.done:
        node = pending.pop(order.randrange(len(pending)) if order else 0)
        ran.append((node.level, node.index))
        tree.finish(node, result(f"s{node.level}.{node.index}"))
        pending += tree.ready()
    return tree, ran


def groups(tree: DocumentTree) -> list[list[tuple[int, int]]]:
    return [[n.children for n in level] for level in tree.levels[1:]]


def test_groups_pack_consecutive_summaries_greedily_until_one_is_left():
    tree, ran = grow(11, limit=4 + 5 * 4)  # four summaries a group
    assert tree.root is not None and tree.error is None
    assert groups(tree) == [[(0, 4), (4, 8), (8, 11)], [(0, 3)]]
    assert tree.root.text == "s2.0" and len(ran) == 11 + 3 + 1
    assert [len(level) for level in tree.levels] == [11, 3, 1]


def test_a_bounded_fan_in_makes_smaller_groups_and_a_deeper_tree():
    tree, ran = grow(11, limit=4 + 5 * 8, max_fan_in=3)  # eight would fit, three may
    assert groups(tree) == [[(0, 3), (3, 6), (6, 9), (9, 11)], [(0, 3), (3, 4)], [(0, 2)]]
    assert tree.root is not None and len(ran) == 11 + 4 + 2 + 1
    wide, _ = grow(11, limit=4 + 5 * 8)
    assert groups(wide) == [[(0, 8), (8, 11)], [(0, 2)]]
    for seed in range(3):  # a full group starts without waiting for the next summary
        other, _ = grow(11, limit=4 + 5 * 8, order=random.Random(seed), max_fan_in=3)
        assert groups(other) == groups(tree)
    started = DocumentTree("doc", [([1], f"d{i}") for i in range(6)], combine, 4 + 5 * 8, 8,
                           max_fan_in=2)
    chunks = started.ready()
    for node in chunks[:2]:
        started.finish(node, result("s"))
    assert [n.children for n in started.ready()] == [(0, 2)]


@pytest.mark.parametrize("fan_in", [None, 3])
def test_the_work_bound_is_the_work_left_when_every_summary_is_as_long_as_allowed(fan_in):
    """Summaries of 3 tokens each (the bound's length): at every point of a run, in any order,
    the bound is exactly the generations and prompt tokens the tree still runs; a summary
    cut short only makes the bound larger than what is left."""
    for seed in range(3):
        final, ran = grow(23, limit=4 + 5 * 4, order=random.Random(seed), max_fan_in=fan_in)
        prompts = {(n.level, n.index): len(n.prompt_ids) for n in final.nodes}
        tree = DocumentTree("doc", [([1], f"d{i}") for i in range(23)], combine, 4 + 5 * 4, 8,
                            max_fan_in=fan_in)
        pending, order, step = tree.ready(), random.Random(seed), 0
        while pending and not tree.done:
            left = ran[step:]
            assert tree.work_bound(3) == (len(left), sum(prompts[p] for p in left))
            node = pending.pop(order.randrange(len(pending)))
            tree.finish(node, result(f"s{node.level}.{node.index}"))
            pending += tree.ready()
            step += 1
        assert tree.work_bound(3) == (0, 0)
    short, ran = grow(23, limit=4 + 5 * 4)  # 3-token summaries, bound taken at 5 tokens
    fresh = DocumentTree("doc", [([1], f"d{i}") for i in range(23)], combine, 4 + 5 * 4, 8)
    assert fresh.work_bound(5)[0] >= len(ran) and fresh.work_bound(3)[0] == len(ran)


def test_a_bounded_fan_in_is_in_the_jobs_identity_and_none_leaves_it_as_it_was(tmp_path):
    plain = job(tmp_path).fingerprint()["long_documents"]
    assert "max_fan_in" not in plain  # outputs written before the option resume
    bounded = job(tmp_path, tree_fan_in=4).fingerprint()["long_documents"]
    assert bounded == {**plain, "max_fan_in": 4}
    with pytest.raises(UserError, match="--tree-fan-in"):
        job(tmp_path, tree_fan_in=1)


def test_the_packing_does_not_depend_on_the_order_nodes_finish_in():
    first, _ = grow(23, limit=4 + 5 * 3)
    for seed in range(5):
        other, _ = grow(23, limit=4 + 5 * 3, order=random.Random(seed))
        assert groups(other) == groups(first)
        assert [[n.digest for n in level] for level in other.levels] == [
            [n.digest for n in level] for level in first.levels]


def test_a_group_starts_once_its_inputs_and_the_next_one_are_done_not_after_its_level():
    tree = DocumentTree("doc", [([1], f"d{i}") for i in range(6)], combine, 4 + 5 * 2, 8)
    chunks = tree.ready()
    for node in chunks[:3]:  # chunks 0, 1 and 2 (2: the first that does not fit 0-1's group)
        tree.finish(node, result("s"))
    started = tree.ready()
    assert [(n.level, n.index, n.children) for n in started] == [(1, 0, (0, 2))]


def test_a_tree_deeper_than_its_bound_fails_the_row():
    tree, _ = grow(30, limit=4 + 5 * 2, max_depth=3)  # 30 -> 15 -> 8 -> ...: 4 levels at least
    assert tree.done and tree.root is None
    assert "more than 3 levels" in tree.error and "--tree-depth" in tree.error


def test_summaries_too_long_to_combine_two_fail_the_row():
    tree, _ = grow(5, limit=4 + 5 * 1)  # one summary a group: the level would not shrink
    assert tree.done and tree.root is None and "cannot combine two summaries" in tree.error


def test_a_known_node_with_the_same_input_is_reused_a_changed_one_is_not():
    full, ran = grow(6, limit=4 + 5 * 3)
    known = {(n.level, n.index): StoredNode(n.digest, n.result) for n in full.nodes}
    again, ran_again = grow(6, limit=4 + 5 * 3, known=known)
    assert ran_again == [] and again.root.text == full.root.text
    known[(0, 2)] = StoredNode("a changed chunk", known[(0, 2)].result)
    changed, ran_changed = grow(6, limit=4 + 5 * 3, known=known)
    # chunk 2 again, then the group it is in (its summary text is the same here: the
    # group's input digest is unchanged, so from there the known nodes serve)
    assert ran_changed == [(0, 2)] and changed.root is not None


# ---------------------------------------------------------------- the job


def long_job(tmp_path, **kw):
    write_input(tmp_path / "in.parquet", ["short", "long", "longer"],
                docs_of([10, 150, 400]))
    return job(tmp_path, **kw)


def test_a_text_job_summarizes_documents_past_the_window_through_trees(tmp_path):
    result, engines = run(long_job(tmp_path, baseline_fraction=0))
    rows = {r["id"]: r for r in read_rows(result.output)}
    assert all(r["error"] is None for r in rows.values())
    assert rows["short"]["document_path"] == "whole" and rows["short"]["tree_chunks"] is None
    nodes = read_rows(result.output, "nodes")
    for key in ("long", "longer"):
        r = rows[key]
        mine = [n for n in nodes if n["id"] == key]
        assert r["document_path"] == "tree" and r["tree_generations"] == len(mine)
        assert r["tree_chunks"] == sum(n["level"] == 0 for n in mine) > 1
        assert r["tree_depth"] == 1 + max(n["level"] for n in mine) >= 2
        top = max(mine, key=lambda n: n["level"])
        assert r["generated_text"] == top["generated_text"]
        assert r["generated_tokens"] == top["generated_tokens"]
        assert r["tree_generated_tokens"] == r["num_generated_tokens"] == sum(
            n["num_generated_tokens"] for n in mine)
        assert r["tree_prompt_tokens"] == sum(n["num_input_tokens"] for n in mine)
        assert r["time_taken_llm"] == pytest.approx(sum(n["time_taken_llm"] for n in mine))
        assert r["num_input_tokens"] == len(docs_of([10, 150, 400])[
            ["short", "long", "longer"].index(key)].split()) + 5  # the whole prompt's
    # every node one generation, keyed by its place in the tree (its sampling seed's key)
    assert len(engines.submits) == 1 + len(nodes)
    s = result.summary
    assert s["rows"]["document_paths"] == {"whole": 1, "tree": 2}
    assert s["rows"]["generations"] == 1 + len(nodes)
    assert s["job"]["long_documents"] == "tree"


def test_fail_and_truncate_keep_their_behaviour_and_prompt_mode_makes_no_tree(tmp_path):
    (tmp_path / "fail").mkdir()
    result, _ = run(long_job(tmp_path / "fail", long_documents="fail", baseline_fraction=0))
    rows = {r["id"]: r for r in read_rows(result.output)}
    assert rows["long"]["error"].startswith("prompt has") and rows["long"]["error_kind"] == "input"
    result, _ = run(long_job(tmp_path, truncate=True, baseline_fraction=0))
    rows = {r["id"]: r for r in read_rows(result.output)}
    assert rows["long"]["document_path"] == "truncated" and rows["long"]["truncated"]
    with pytest.raises(UserError, match="needs --text-column"):
        job(tmp_path, text_column=None, prompt_column="p", long_documents="tree")


def test_a_job_killed_between_levels_redoes_no_node_and_writes_each_row_once(tmp_path):
    class Crash(BaseException):  # like SIGKILL: not a row's error
        pass

    (tmp_path / "fresh").mkdir()
    fresh, whole = run(long_job(tmp_path / "fresh", baseline_fraction=0))

    def crash(answered, backend):
        if answered == len(whole.submits) - 4:  # a tree's last levels left
            raise Crash()

    with pytest.raises(Crash):
        run(long_job(tmp_path, baseline_fraction=0), FakeEngines(after_answers=crash))
    kept = read_rows(str(tmp_path / "out"), "nodes")
    first_rows = {r["id"] for r in read_rows(str(tmp_path / "out"))}
    cut = [k for k in ("long", "longer") if k not in first_rows]
    assert cut and max(n["level"] for n in kept if n["id"] == cut[0]) >= 1  # inside its tree

    result, engines = run(long_job(tmp_path, baseline_fraction=0))
    nodes = read_rows(result.output, "nodes")
    places = [(n["id"], n["level"], n["index"]) for n in nodes]
    assert len(places) == len(set(places))  # no node twice
    assert len(engines.submits) == len(nodes) - len(kept) + ("short" not in first_rows)
    rows = read_rows(result.output)
    assert sorted(r["id"] for r in rows) == ["long", "longer", "short"]  # each once
    assert {r["id"]: r["generated_text"] for r in rows} == {
        r["id"]: r["generated_text"] for r in read_rows(fresh.output)}


def test_the_speedup_baseline_runs_the_same_trees_under_ar(tmp_path):
    result, engines = run(long_job(tmp_path, baseline_fraction=1.0))
    nodes = read_rows(result.output, "nodes")
    by_pass = {p: {(n["id"], n["level"], n["index"]) for n in nodes if n["pass"] == p}
               for p in ("rows", "baseline_strategy", "baseline")}
    assert by_pass["rows"] == by_pass["baseline_strategy"] == by_pass["baseline"]
    base = {r["id"]: r for r in read_rows(result.output, "baseline")}
    assert base["longer"]["document_path"] == "tree" and base["longer"]["strategy"] == "ar"
    b = result.summary["baseline"]
    assert b["rows"] == 3 and b["identical_tokens"] == 3
    assert b["speedup"] == pytest.approx(30.0 / 20.0)  # the fakes' knapspec over ar speeds


def test_stop_after_counts_a_tree_as_one_row_and_a_rerun_finishes_the_rest(tmp_path):
    first, _ = run(long_job(tmp_path, stop_after=1, baseline_fraction=0))
    assert first.stopped_early and len(read_rows(first.output)) == 1
    assert read_rows(first.output)[0]["document_path"] == "tree"  # the longest goes first
    second, engines = run(long_job(tmp_path, baseline_fraction=0))
    assert sorted(r["id"] for r in read_rows(second.output)) == ["long", "longer", "short"]
    places = [(n["id"], n["level"], n["index"]) for n in read_rows(second.output, "nodes")]
    assert len(places) == len(set(places))


class Recording(FakeBackend):
    """Keeps the key of every submission: a row's id, a node's (row id, level, index)."""

    keys: list = []

    def submit(self, replica, prompt_ids, config, key=None):
        Recording.keys.append(key)
        return super().submit(replica, prompt_ids, config, key)


def test_short_rows_start_beside_a_book_one_node_per_row_ahead_at_most(tmp_path):
    """The book comes first (longest first) and brings dozens of chunk summaries; each short
    row still starts after at most one node per row ahead of it, plus the tasks in flight,
    and every short row ends before the book's last node."""
    shorts = [f"s{i}" for i in range(6)]
    write_input(tmp_path / "in.parquet", ["book", *shorts], docs_of([900] + [8] * 6))
    Recording.keys = []
    result = run_job(job(tmp_path, baseline_fraction=0, max_num_seqs=2),
                     engine_factory=FakeEngines(), backend_factory=Recording,
                     text_tools=fake_tools(64))
    keys = Recording.keys
    nodes = [i for i, k in enumerate(keys) if isinstance(k, tuple)]
    assert len(nodes) > 30  # a book: its chunks and the levels above them
    inflight = 2 + 2  # the job's max_num_seqs and the two rows queued on the replica
    for k, row in enumerate(shorts):
        start = keys.index(row)
        assert sum(i < start for i in nodes) <= 1 + k + inflight, (row, keys[:start + 1])
    rows = read_rows(result.output)
    assert all(r["error"] is None for r in rows) and len(rows) == 7
    assert max(keys.index(row) for row in shorts) < len(keys) // 3  # early, not after the book


def test_a_free_slot_goes_to_a_new_row_and_a_started_rows_task_in_turn():
    """The dispatcher alone: one slot, a row whose first answer brings five tasks of its own
    (as a tree's chunks), then three rows; a retried task still goes first."""

    class Part(Task):
        @property
        def row(self):
            return "book"

    class OneSlot(FakeBackend):
        def __init__(self):
            super().__init__(FakeEngines()(JobConfig(input="x", output="y"),
                                           StrategyOptions(name="ar"), 1))
            self.order = []

        def submit(self, replica, prompt_ids, config, key=None):
            self.order.append(key)
            return super().submit(replica, prompt_ids, config, key)

    backend = OneSlot()
    dispatcher = Dispatcher(backend, GenerationConfig.of(max_new_tokens=2), max_inflight=1)

    def on_result(outcome):
        if outcome.task.key == "book":
            for i in range(5):
                dispatcher.push(Part(("book", i), [7, i], continues=True), first=False)

    rows = [Task("book", [1, 2]), *(Task(f"r{i}", [3, i]) for i in range(3))]
    dispatcher.run(iter(rows), on_result, lookahead=0)
    assert backend.order == ["book", ("book", 0), "r0", ("book", 1), "r1", ("book", 2), "r2",
                             ("book", 3), ("book", 4)]

    # three slots, the book's tasks pushed as it is read (as TreeDispatch.expand does): the
    # free slots still go to a row and a task in turn, rows read as their turn comes
    backend = OneSlot()
    dispatcher = Dispatcher(backend, GenerationConfig.of(max_new_tokens=2), max_inflight=3)

    def source():
        yield Task("book", [1, 2])
        for i in range(5):
            dispatcher.push(Part(("book", i), [7, i], continues=True), first=False)
        yield from (Task(f"r{i}", [3, i]) for i in range(3))

    dispatcher.run(source(), lambda outcome: None, lookahead=0)
    assert backend.order == ["book", ("book", 0), "r0", ("book", 1), "r1", ("book", 2), "r2",
                             ("book", 3), ("book", 4)]


def test_the_progress_line_counts_a_trees_generations_and_rows_as_the_report_does(tmp_path,
                                                                                   caplog):
    with caplog.at_level(logging.INFO, logger="knapspec_dist.jobs"):
        result, engines = run(long_job(tmp_path, baseline_fraction=0))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rows: ")]
    generations = len(engines.submits)
    assert f"3/3 rows (0 failed, {generations}/~{generations} generations)" in lines[-1]
    early = next(line for line in lines if "generations" in line)
    expected = int(early.split("/~")[1].split()[0])
    assert expected >= generations  # the trees' bound, until they end
    (tmp_path / "fail").mkdir()
    with caplog.at_level(logging.INFO, logger="knapspec_dist.jobs"):
        caplog.clear()
        result, _ = run(long_job(tmp_path / "fail", long_documents="fail", baseline_fraction=0))
    last = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rows: ")][-1]
    assert result.summary["rows"]["failed"] == 2
    assert "rows: 3/3 rows (2 failed)" in last

