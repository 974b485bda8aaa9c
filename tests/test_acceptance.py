"""The default KnapSpec's acceptance estimate and exit-aware draft length, on worked examples."""

from __future__ import annotations

import pytest
import torch

from knapspec_dist.engine.sequence import Batch, Row
from knapspec_dist.model.cache import KVCache
from knapspec_dist.speculation import tpt
from knapspec_dist.speculation.acceptance import AcceptanceBook, Estimate, similarity
from knapspec_dist.speculation.knapspec import KnapSpecSelector

from synthetic import LINEAR_ATTENTION, synthetic_profile


def test_book_pools_the_dp_and_the_run_by_subnet_overlap():
    book = AcceptanceBook()
    # two rows drafted with {2, 4} at gamma 10: one kept all 10; one judged 3 (an exit) and
    # kept 1 (a rejection)
    book.record(frozenset({2, 4}), 10, [10, 3], [10, 1])
    same = book.estimate(frozenset({2, 4}), agree=4, positions=5)
    assert (same.a, same.b) == (1 + 4 + 11, 1 + 1 + 1)
    near = book.estimate(frozenset({2, 4, 6}), agree=4, positions=5)  # overlap 2/3
    assert (near.a, near.b) == pytest.approx((1 + 4 + 11 * 2 / 3, 1 + 1 + 2 / 3))
    far = book.estimate(frozenset({8}), agree=4, positions=5)  # disjoint: the DP alone
    assert (far.a, far.b) == (5, 2)
    assert book.exit_rate == pytest.approx(1 / 14)  # one exit in 13 judged positions (+1)
    assert similarity(frozenset({1, 2}), frozenset({2, 3})) == pytest.approx(1 / 3)


def test_estimate_spread_shrinks_with_evidence():
    few, many = Estimate(6, 1), Estimate(51, 6)  # 5 of 5 agree; 50 of 55
    assert few.mean == pytest.approx(6 / 7) and few.sd == pytest.approx((6 / (49 * 8)) ** 0.5)
    assert many.sd < few.sd / 2
    assert few.lower(1.0) == pytest.approx(few.mean - few.sd)
    assert Estimate(1, 100).lower(3.0) == 0.0


def test_expected_tokens_under_the_confidence_exit():
    """alpha 1, gamma 3, exit 0.5 per position: drafts judged 1 + 0.5 + 0.25, tokens one more."""
    assert tpt.expected_drafts(3, 0.5) == pytest.approx(1.75)
    assert tpt.expected_tokens(1.0, 3, 0.5) == pytest.approx(2.75)
    assert tpt.expected_tokens(0.8, 4, 0.0) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    verify = lambda q: 1.0 + 0.1 * q  # noqa: E731
    assert tpt.tokens_per_time(1.0, 3, 0.2, verify, 0.5) == pytest.approx(
        2.75 / (1.75 * 0.2 + 1.0 + 0.1 * 2.75))


def test_references_are_the_last_m_rounds(engine_model):
    """Six rounds of two committed positions each: the DP judges the last five rounds' ten
    positions, ending at the row's end."""
    model = engine_model("llama-gqa")
    selector = KnapSpecSelector(synthetic_profile(model, LINEAR_ATTENTION))
    selector.start(model)
    cache = KVCache(model.cfg, 1, 64, dtype=model.dtype, device="cpu")
    cache.commit(0, 40)
    batch = Batch(cache, rows=[Row(7, [], 10)])
    layers = model.cfg.num_layers
    for k in range(6):
        hidden = [torch.tensor([[[2.0 * k], [2.0 * k + 1]]]) for _ in range(2 * layers + 1)]
        selector.observe(hidden, [2], [7])
    assert selector.reference_positions(batch) == 10
    (ref,) = selector.references(batch)
    assert (ref.slot, ref.start) == (0, 30)
    assert ref.states[0, :, 0].tolist() == [float(x) for x in range(2, 12)]
