"""The job's progress under continuous batching, on a simulated clock: tokens are counted as
they are generated (not when rows finish), and the ETA shown once a tenth, a quarter and half
of the job have passed is within 30 % of the time the job really had left then, in decode-heavy
and in prefill-heavy jobs (long prompts, few new tokens: the demo). (In the last wave, when
fewer rows than slots remain, the token rate falls and the ETA runs short: the estimate
assumes the rate so far.)"""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest

from knapspec_dist.engine.scheduler import Work
from knapspec_dist.jobs.progress import Progress


def simulate(lengths: list[int], slots: int, step_s: float = 0.1, prompts: list[int] | None = None,
             prefill_s_per_token: float = 0.0):
    """Continuous batching of rows with the given token counts over ``slots`` rows at once,
    one token per decoding row per step; an admitted row is first prefilled (its prompt tokens
    at ``prefill_s_per_token``, the others waiting, as one replica does). Returns the view at
    every step: (time, Work so far, finished rows so far as (row index, tokens))."""
    prompts = prompts or [0] * len(lengths)
    waiting = list(range(len(lengths)))
    active: dict[int, int] = {}
    t, work, finished, timeline = 0.0, Work(), [], []
    while waiting or active:
        while waiting and len(active) < slots:
            row = waiting.pop(0)
            spent = prompts[row] * prefill_s_per_token or 1e-6
            t += spent
            work = work + Work(emitted=1, prefilled=prompts[row], prefill_s=spent)
            active[row] = 1
            timeline.append((t, work, list(finished)))
        t += step_s
        work = work + Work(decode_s=step_s)
        for row in list(active):
            if active[row] == lengths[row]:
                finished.append((row, lengths[row]))
                del active[row]
                continue
            active[row] += 1
            work = work + Work(emitted=1)
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
    seen, errors, marks, checked = 0, [], (0.1, 0.25, 0.5), set()
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
    now[0], live[0] = 20.0, Work(emitted=300, prefilled=4000, prefill_s=4.0, decode_s=6.0)
    with caplog.at_level(logging.INFO, logger="knapspec_dist.jobs.runner"):
        progress.tick()
    assert "prefilled 4000/8000 prompt tokens (1000 tok/s), 300 tokens, 30.0 tok/s" in caplog.text
    assert progress.done == 0 and progress.tokens == 300
    assert progress.tokens_per_s == pytest.approx(30.0)
    # 4000 prompt tokens left at 1000/s, then 8 x 128 - 300 tokens at 50/s
    assert progress.eta() == pytest.approx(4.0 + (8 * 128 - 300) / 50.0)


def test_replicas_prefill_and_decode_side_by_side():
    """Two replicas' seconds are summed in their Work: each ran for half of them."""
    progress = Progress(total=4, every=0.0, label="rows", bar_enabled=False, max_new_tokens=10,
                        live=lambda: None, replicas=2, prompt_tokens=4000)
    progress.work = Work(emitted=4, prefilled=2000, prefill_s=4.0, decode_s=1.0)
    assert progress.eta() == pytest.approx(2000 / 1000 + (4 * 10 - 4) / 8.0)


@pytest.mark.parametrize("case", ["all reach the limit", "mixed lengths", "prefill-heavy"])
def test_eta_is_within_30_percent_from_a_tenth_of_the_job_on(case):
    rng = random.Random(0)
    prefill = {}
    if case == "all reach the limit":  # summaries cut at --max-new-tokens, 3 waves of rows
        lengths, limit, slots = [96] * 40, 96, 16
    elif case == "mixed lengths":  # rows stop at EOS anywhere between 40 and 120 tokens
        lengths, limit, slots = [rng.randint(40, 120) for _ in range(200)], 128, 16
    else:  # the demo: 12 chapters of 1k-6k tokens, 2 at a time, prefill most of the time
        lengths, limit, slots = [rng.randint(48, 64) for _ in range(12)], 64, 2
        prefill = {"prompts": [rng.randint(1000, 6000) for _ in range(12)],
                   "prefill_s_per_token": 0.002}
    errors = eta_errors(lengths, slots=slots, max_new_tokens=limit, **prefill)
    assert errors and max(errors) <= 0.30, max(errors)


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
    now[0], live[0] = 100.0, Work(emitted=2 * 5 + 10 * 8, prefill_s=10.0, decode_s=90.0)
    progress.tick()
    row_rate = (2 * 5 + 10 * 8) / 90.0 / 12
    assert progress.eta() == pytest.approx((96 - 8) / 2 / row_rate)
