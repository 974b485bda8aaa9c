"""The job's progress under continuous batching, on a simulated clock: tokens are counted as
they are generated (not when rows finish), and the ETA shown once a tenth, a quarter, half and
three quarters of the job have passed is within 30 % of the time the job really had left then,
in decode-heavy and in prefill-heavy jobs (long prompts, few new tokens: the demo, where rows
join one by one between prefill chunks, so only a few decode at once until late). (In the last
wave, when fewer rows than slots remain, the token rate falls and the ETA runs short: the
estimate assumes the rate so far.)"""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest

from knapspec_dist.engine.scheduler import Work
from knapspec_dist.jobs.progress import Progress
from knapspec_dist.runtime.messages import KVReport

MARKS = (0.1, 0.25, 0.5, 0.75)  # fractions of the job at which the ETA is checked


def simulate(lengths: list[int], slots: int, step_s: float = 0.1, prompts: list[int] | None = None,
             prefill_s_per_token: float = 0.0, chunk: int | None = None, row_s: float = 0.0,
             per_round: int = 1, load=lambda t: 1.0):
    """Continuous batching as engine/scheduler.py does it, of rows with the given token counts
    over ``slots`` rows at once. Each step admits rows and prefills their prompts (at
    ``prefill_s_per_token``), one at a time: at most ``chunk`` prompt tokens while rows are
    decoding (a long prompt is cut across steps; None: whole prompts), without limit while
    none is; a row whose prompt is in joins with its first token. Then one round over the
    decoding rows, ``step_s + row_s`` per row long, ``per_round`` tokens per row (more than
    one: speculation). ``load(t)``: how many times slower the machine is at ``t`` (other
    work beside the job). Returns the view at every step: (time, Work so far, finished rows so
    far as (row index, tokens))."""
    prompts = prompts or [0] * len(lengths)
    waiting, prefilling, done_prompt = list(range(len(lengths))), None, 0
    active: dict[int, int] = {}
    t, work, finished, timeline = 0.0, Work(), [], []
    while waiting or prefilling is not None or active:
        budget = float("inf") if chunk is None else chunk  # prompt tokens, while rows decode
        while True:
            if prefilling is None and waiting and len(active) < slots:
                prefilling, done_prompt = waiting.pop(0), 0
            if prefilling is None or (active and budget <= 0):
                break
            left = prompts[prefilling] - done_prompt
            n = min(left, budget) if active else left
            budget -= n
            done_prompt += n
            spent = max(n * prefill_s_per_token, 1e-6) * load(t)
            t += spent
            work = work + Work(prefilled=n, prefill_s=spent)
            if done_prompt == prompts[prefilling]:
                active[prefilling] = 1
                work = work + Work(emitted=1)
                prefilling = None
        if active:
            size = len(active)
            spent = (step_s + row_s * size) * load(t)
            t += spent
            made = 0
            for row in list(active):
                n = min(per_round, lengths[row] - active[row])
                active[row] += n
                made += n
                if active[row] == lengths[row]:
                    finished.append((row, lengths[row]))
                    del active[row]
            work = work + Work(emitted=made, decoded=made, decode_s=spent, rounds=1,
                               row_rounds=size)
        timeline.append((t, work, list(finished)))
    return timeline


def eta_errors(lengths: list[int], slots: int, max_new_tokens: int, **prefill) -> list[float]:
    timeline = simulate(lengths, slots, **prefill)
    end = timeline[-1][0]
    now = [0.0]
    live = [Work()]
    progress = Progress(total=len(lengths), every=0.0, label="rows", bar_enabled=False,
                        max_new_tokens=max_new_tokens, live=lambda: live[0],
                        slots=slots, clock=lambda: now[0],
                        prompt_tokens=sum(prefill.get("prompts") or [0]))
    seen, errors, marks, checked = 0, [], MARKS, set()
    for t, work, finished in timeline:
        now[0], live[0] = t, work
        for row, tokens in finished[seen:]:
            stats = SimpleNamespace(new_tokens=tokens)
            progress.update(SimpleNamespace(error=None, result=SimpleNamespace(stats=stats)))
        seen = len(finished)
        progress.tick()
        for mark in marks:
            if mark not in checked and t >= mark * end:
                checked.add(mark)
                errors.append(abs(progress.eta() - (end - t)) / (end - t))
    assert checked == set(marks)
    return errors


def test_tokens_count_before_any_row_finishes(caplog):
    now, live = [10.0], [Work()]
    progress = Progress(total=8, every=0.0, label="rows", bar_enabled=False,
                        live=lambda: live[0], clock=lambda: now[0], prompt_tokens=8000)
    assert progress.eta() is None  # nothing measured yet
    now[0], live[0] = 20.0, Work(emitted=300, prefilled=4000, prefill_s=4.0, decode_s=6.0,
                                 decoded=240, rounds=60, row_rounds=240)
    with caplog.at_level(logging.INFO, logger="knapspec_dist.jobs"):
        progress.tick()
    assert "prefilled 4000/8000 prompt tokens (1000 tok/s), 300 tokens, 30.0 tok/s" in caplog.text
    assert progress.done == 0 and progress.tokens == 300
    assert progress.tokens_per_s == pytest.approx(30.0)
    # 4000 prompt tokens left at 1000/s, then 8 x 128 - 300 tokens at 240 / 6 = 40/s
    assert progress.eta() == pytest.approx(4.0 + (8 * 128 - 300) / 40.0)


def test_replicas_prefill_and_decode_side_by_side():
    """Two replicas' seconds are summed in their Work: each ran for half of them."""
    progress = Progress(total=4, every=0.0, label="rows", bar_enabled=False, max_new_tokens=10,
                        live=lambda: None, replicas=2, prompt_tokens=4000)
    progress.work = Work(emitted=4, prefilled=2000, prefill_s=4.0, decode_s=1.0, decoded=4,
                         rounds=4, row_rounds=4)
    assert progress.eta() == pytest.approx(2000 / 1000 + (4 * 10 - 4) / 8.0)


CASES = ["all reach the limit", "mixed lengths", "prefill-heavy", "rows join between chunks",
         "rows join between chunks, speculating"]


@pytest.mark.parametrize("case", CASES)
def test_eta_is_within_30_percent_from_a_tenth_of_the_job_on(case):
    rng = random.Random(0)
    prefill = {}
    if case == "all reach the limit":  # summaries cut at --max-new-tokens, 3 waves of rows
        lengths, limit, slots = [96] * 40, 96, 16
    elif case == "mixed lengths":  # rows stop at EOS anywhere between 40 and 120 tokens
        lengths, limit, slots = [rng.randint(40, 120) for _ in range(200)], 128, 16
    elif case == "prefill-heavy":  # 12 chapters of 1k-6k tokens, 2 at a time, whole prompts
        lengths, limit, slots = [rng.randint(48, 64) for _ in range(12)], 64, 2
        prefill = {"prompts": [rng.randint(1000, 6000) for _ in range(12)],
                   "prefill_s_per_token": 0.002}
    else:  # the demo: 12 chapters of 1k-6k tokens into 16 slots, prefilled 2048 tokens per
        # step between rounds (so rows join one by one and 1-3 decode at once until the last
        # prompt is in), at ~100 prompt tokens/s, a round ~0.6 s whatever its rows (a CPU)
        lengths, limit, slots = [rng.randint(40, 96) for _ in range(12)], 96, 16
        prefill = {"prompts": [rng.randint(1000, 6000) for _ in range(12)],
                   "prefill_s_per_token": 0.01, "chunk": 2048, "step_s": 0.6, "row_s": 0.02,
                   "per_round": 3 if case.endswith("speculating") else 1}
    errors = eta_errors(lengths, slots=slots, max_new_tokens=limit, **prefill)
    assert len(errors) == len(MARKS) and max(errors) <= 0.30, errors


def test_rows_join_one_by_one_in_the_demo_simulation():
    """The case above is the demo's shape: most of the pass, few of the 16 slots decode."""
    rng = random.Random(0)
    lengths = [rng.randint(40, 96) for _ in range(12)]
    prompts = [rng.randint(1000, 6000) for _ in range(12)]
    timeline = simulate(lengths, 16, prompts=prompts, prefill_s_per_token=0.01, chunk=2048,
                        step_s=0.6, row_s=0.02)
    prefilled_at = next(t for t, w, _ in timeline if w.prefilled == sum(prompts))
    assert prefilled_at > 0.6 * timeline[-1][0]  # prefill is most of the pass
    half = next(w for _, w, _ in timeline if w.prefilled >= sum(prompts) / 2)
    assert half.row_rounds / half.rounds <= 3  # rows decoding at once, of 12
    assert timeline[-1][1].decoded == sum(lengths) - 12  # the first tokens come from prefill


def test_without_live_counts_the_wall_clock_token_rate():
    now = [0.0]
    progress = Progress(total=8, every=0.0, label="rows", bar_enabled=False, max_new_tokens=10,
                        clock=lambda: now[0])
    stats = SimpleNamespace(new_tokens=10)
    now[0] = 5.0
    progress.update(SimpleNamespace(error=None, result=SimpleNamespace(stats=stats)))
    assert progress.eta() == pytest.approx(7 * 10 / 2.0)


def test_rows_that_stopped_early_do_not_make_the_others_short():
    """Two rows stopped at EOS after 5 tokens; ten still decode with 8 each: the ETA still
    expects at least half of their remaining budget (it showed 0 s in a demo before)."""
    now, live = [0.0], [Work()]
    progress = Progress(total=12, every=0.0, label="rows", bar_enabled=False, max_new_tokens=96,
                        live=lambda: live[0], slots=16, clock=lambda: now[0])
    for _ in range(2):
        stats = SimpleNamespace(new_tokens=5)
        progress.update(SimpleNamespace(error=None, result=SimpleNamespace(stats=stats)))
    # 7 rounds of 12 rows, then of 10: each row's tokens after its first one
    now[0], live[0] = 100.0, Work(emitted=2 * 5 + 10 * 8, prefill_s=10.0, decode_s=90.0,
                                  decoded=2 * 4 + 10 * 7, rounds=7, row_rounds=2 * 4 + 10 * 7)
    progress.tick()
    row_rate = 1 / (90.0 / 7)  # a token per round, a round every 90 / 7 s
    assert progress.eta() == pytest.approx((96 - 8) / 2 / row_rate)


def test_one_rows_rate_is_its_tokens_per_round_over_a_rounds_seconds():
    """Two of 16 slots decode (the others wait for prefill), 3 tokens a round each
    (speculation), a round a second: a row makes 3 tokens/s, not the replicas' 6 tokens/s
    over 12 rows."""
    progress = Progress(total=12, every=0.0, label="rows", bar_enabled=False, max_new_tokens=96,
                        live=lambda: None, slots=16)
    progress.work = Work(emitted=2 + 60, prefilled=5000, prefill_s=50.0, decode_s=10.0,
                         decoded=60, rounds=10, row_rounds=20)
    done_each = 62 / 12  # the 12 rows' tokens so far, each
    assert progress.eta() == pytest.approx((96 - done_each) / 3.0)


def test_rows_waiting_for_memory_make_the_waves_as_wide_as_the_pool_held():
    """A cap of 16 rows, but the pool held 4 at once and rows waited for pages: 12 rows left
    go in waves of 4, not 16 (the ETA once said a third of the real time)."""
    kv = KVReport(paged=True, page_size=16, pages=100, tokens=1600, bytes=1, max_num_seqs=16,
                  peak_tokens=1600, peak_use=1.0, peak_rows=4, mean_rows=3.5,
                  memory_wait_s=2.0, rows_waited=3)
    progress = Progress(total=12, every=0.0, label="rows", bar_enabled=False, max_new_tokens=10,
                        live=lambda: None, slots=16, memory=lambda: kv)
    progress.work = Work(emitted=4, prefilled=5000, prefill_s=50.0, decode_s=1.0, decoded=4,
                         rounds=1, row_rounds=4)
    progress.tick()
    assert progress.in_flight() == 4
    row_rate = 1.0  # a token a round, a round a second
    assert progress.eta() == pytest.approx((10 - 1 + 2 * 10) / row_rate)
    progress.kv = None
    assert progress.in_flight() == 16


def test_the_line_counts_a_trees_generations_beside_its_rows(caplog):
    """A row summarized through a tree is one row and several generations (its nodes); the
    line says both once they differ, as summary.json's ``rows.generations`` does."""
    def outcome(tokens: int | None):
        result = None if tokens is None else SimpleNamespace(
            stats=SimpleNamespace(new_tokens=tokens))
        return SimpleNamespace(result=result, error=None)

    progress = Progress(total=2, every=0.0, label="rows", bar_enabled=False,
                        clock=lambda: 1.0)
    with caplog.at_level(logging.INFO, logger="knapspec_dist.jobs"):
        progress.update(outcome(5))  # an ordinary row: one generation
        assert "1/2 rows (0 failed)," in caplog.text
        for _ in range(3):  # a tree's three nodes, then its row (no result of its own)
            progress.add_tokens(outcome(4))
        progress.update(outcome(None))
    assert progress.generations == 4 and progress.finished_tokens == 17
    assert "2/2 rows (0 failed, 4 generations), 17 tokens" in caplog.text


BOOK = ["chunk", "short"] * 20 + ["chunk"] * 130 + ["root"]  # 150 chunks, 20 short rows


def book_eta(load=lambda t: 1.0):
    """A book of 150 chunks (2,000 prompt tokens each, 32-token summaries, one combining node
    above them) beside 20 short rows, replayed: the dispatcher's turns put a short row
    between chunks until they are all in. Returns the progress at the end, the pass's length
    and, at every step, (time, the ETA over the time really left or its inverse: >= 1)."""
    prompts = [{"chunk": 2000, "short": 500, "root": 150 * 34}[k] for k in BOOK]
    timeline = simulate([32] * len(BOOK), 8, prompts=prompts, prefill_s_per_token=0.004,
                        chunk=2048, step_s=0.5, row_s=0.02, load=load)
    end, now, live = timeline[-1][0], [0.0], [Work()]
    progress = Progress(total=21, every=0.0, label="rows", bar_enabled=False,
                        max_new_tokens=32, live=lambda: live[0], slots=8,
                        clock=lambda: now[0], generations_total=len(BOOK),
                        prompt_tokens=sum(prompts))
    seen, ratios = 0, []
    for t, work, finished in timeline:
        now[0], live[0] = t, work
        for index, tokens in finished[seen:]:
            outcome = SimpleNamespace(error=None, result=SimpleNamespace(
                stats=SimpleNamespace(new_tokens=tokens)))
            if BOOK[index] == "short":
                progress.update(outcome)
            else:
                progress.add_tokens(outcome)
                if BOOK[index] == "root":  # the book's row: its nodes' tokens came already
                    progress.update(SimpleNamespace(error=None, result=None))
        seen = len(finished)
        progress.tick()
        if t < end:
            eta = progress.eta()
            ratios.append((t, max(eta / (end - t), (end - t) / eta) if eta else float("inf")))
    return progress, end, ratios


def test_a_books_eta_counts_its_generations_and_prompt_tokens_not_its_rows():
    """The line counts 171 generations for 21 rows, and from a tenth of the job to its last
    half minute the ETA is within a factor of 1.5 of the time left."""
    progress, end, ratios = book_eta()
    assert progress.done == 21 and progress.generations == len(BOOK)
    checked = [r for t, r in ratios if 0.1 * end <= t <= 0.98 * end]
    assert len(checked) > 100 and max(checked) <= 1.5, max(checked)


def test_the_eta_follows_a_machine_that_speeds_up():
    """The machine twice as slow for the first ten minutes (other work beside the job), then
    quiet: from one window after the change to the last half minute the ETA is within 1.5x
    of the time left. (Before it no estimate can know the machine will speed up.) A rate
    over the whole pass still reads the slow minutes: up to 1.7x off there."""
    change = 600.0
    progress, end, ratios = book_eta(load=lambda t: 2.0 if t < change else 1.0)
    assert end > change + 2 * progress.window
    after = [r for t, r in ratios if change + progress.window <= t <= 0.98 * end]
    assert len(after) > 20 and max(after) <= 1.5, max(after)


def test_rows_failed_on_their_input_count_as_done_and_failed_as_the_report_does(caplog):
    progress = Progress(total=4, every=0.0, label="rows", bar_enabled=False,
                        clock=lambda: 1.0, generations_total=2)
    progress.skipped = 2
    with caplog.at_level(logging.INFO, logger="knapspec_dist.jobs"):
        progress.tick(force=True)
    assert "rows: 2/4 rows (2 failed)" in caplog.text
