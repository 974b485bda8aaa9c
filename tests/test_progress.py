"""The job's progress under continuous batching, on a simulated clock: tokens are counted as
they are generated (not when rows finish), and the ETA shown once a tenth, a quarter and half
of the job have passed is within 30 % of the time the job really had left then. (In the last
wave, when fewer rows than slots remain, the token rate falls and the ETA runs short: the
estimate assumes the rate so far.)"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from knapspec_dist.jobs.progress import Progress


def simulate(lengths: list[int], slots: int, step_s: float = 0.1, startup_s: float = 0.0):
    """Continuous batching of rows with the given token counts over ``slots`` rows at once,
    one token per decoding row per step. Returns the progress object's view at every step:
    (time, live tokens, finished rows so far as (row index, tokens))."""
    waiting = list(range(len(lengths)))
    active: dict[int, int] = {}
    t, emitted, finished, timeline = startup_s, 0, [], []
    while waiting or active:
        while waiting and len(active) < slots:
            active[waiting.pop(0)] = 0
        t += step_s
        for row in list(active):
            active[row] += 1
            emitted += 1
            if active[row] == lengths[row]:
                finished.append((row, lengths[row]))
                del active[row]
        timeline.append((t, emitted, list(finished)))
    return timeline


def eta_errors(lengths: list[int], slots: int, max_new_tokens: int) -> list[float]:
    timeline = simulate(lengths, slots)
    end = timeline[-1][0]
    now = [0.0]
    live = [0]
    progress = Progress(total=len(lengths), every=0.0, label="rows", bar_enabled=False,
                        max_new_tokens=max_new_tokens, live=lambda: live[0],
                        slots=slots, clock=lambda: now[0])
    seen, errors, marks, checked = 0, [], (0.1, 0.25, 0.5), set()
    for t, emitted, finished in timeline:
        now[0], live[0] = t, emitted
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


def test_tokens_count_before_any_row_finishes():
    now, live = [10.0], [0]
    progress = Progress(total=8, every=0.0, label="rows", bar_enabled=False,
                        live=lambda: live[0], clock=lambda: now[0])
    now[0], live[0] = 20.0, 300
    progress.tick()
    assert progress.done == 0 and progress.tokens == 300
    assert progress.tokens_per_s == pytest.approx(30.0)
    assert progress.eta() == pytest.approx((8 * 128 - 300) / 30.0)


@pytest.mark.parametrize("case", ["all reach the limit", "mixed lengths"])
def test_eta_is_within_30_percent_from_a_tenth_of_the_job_on(case):
    rng = random.Random(0)
    if case == "all reach the limit":  # summaries cut at --max-new-tokens, 3 waves of rows
        lengths, limit = [96] * 40, 96
    else:  # rows stop at EOS anywhere between 40 and 120 tokens
        lengths, limit = [rng.randint(40, 120) for _ in range(200)], 128
    errors = eta_errors(lengths, slots=16, max_new_tokens=limit)
    assert errors and max(errors) <= 0.30, max(errors)


def test_rows_that_stopped_early_do_not_make_the_others_short():
    """Two rows stopped at EOS after 5 tokens; ten still decode with 8 each: the ETA still
    expects at least half of their remaining budget (it showed 0 s in a demo before)."""
    now, live = [0.0], [0]
    progress = Progress(total=12, every=0.0, label="rows", bar_enabled=False, max_new_tokens=96,
                        live=lambda: live[0], slots=16, clock=lambda: now[0])
    for _ in range(2):
        stats = SimpleNamespace(new_tokens=5)
        progress.update(SimpleNamespace(error=None, result=SimpleNamespace(stats=stats)))
    now[0], live[0] = 100.0, 2 * 5 + 10 * 8
    progress.tick()
    row_rate = progress.tokens_per_s / 12
    assert progress.eta() == pytest.approx((96 - 8) / 2 / row_rate)
