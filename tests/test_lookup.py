"""Drafts copied from a row's own tokens (speculation/lookup.py): the index proposes what
followed the latest earlier occurrence of the longest suffix, the price takes copies only
where they pay, and through the real round copied drafts that are right, wrong or partly
right leave the tokens plain decoding's (greedy and coupled sampling) or distributed as the
model's (rejection sampling)."""

from __future__ import annotations

import pytest
import torch

from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.pages import Paging
from knapspec_dist.engine.sampling import SamplingConfig
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.lookup import (
    CopiedDrafts,
    CopyBook,
    TokenIndex,
    VerifyPrices,
    best_round,
)
from knapspec_dist.speculation.selfspec import Plan, Selector, SelfSpeculative

from copies import CASES, Given, PerToken, copies_of, ragged_copies, ragged_rounds
from distributions import NEW, PROMPT, assert_matches_exact, exact_distribution


def test_the_index_proposes_what_followed_the_latest_earlier_occurrence():
    index = TokenIndex([1, 2, 3, 4, 9, 2, 3, 5, 6, 7])
    assert index.propose() == ([], 0)  # (6, 7) never occurred before
    index.extend([1, 2, 3])  # suffix (1, 2, 3): at 0, followed by 4 ...
    assert index.propose(3) == ([4, 9, 2], 3)
    index.extend([8, 2, 3])  # (8, 2, 3) is new, (2, 3) last occurred at 11: then 8
    assert index.propose(2) == ([8, 2], 2)
    index.extend([5])  # (2, 3, 5) at 5..7, followed by 6, 7, 1, ...
    assert index.propose(4) == ([6, 7, 1, 2], 3)
    assert TokenIndex([4, 4]).propose() == ([], 0)  # the suffix is not its own match
    assert TokenIndex([4, 4, 4]).propose() == ([4], 2)


def test_an_index_kept_up_to_date_equals_one_built_at_once():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (400,), generator=g).tolist()
    grown = TokenIndex(tokens[:50])
    for i in range(50, 400, 7):
        grown.extend(tokens[i:i + 7])
        assert grown.propose() == TokenIndex(tokens[:i + 7]).propose()


def test_the_price_takes_copies_only_where_they_pay():
    book = CopyBook()
    for _ in range(50):  # matches of 3 tokens: 9 in 10 copied tokens kept
        book.record(3, 10, 9)
        book.record(2, 10, 0)  # of 2: none
    assert book.alpha(3) > 0.8 and book.alpha(2) < 0.05
    step = 0.05

    cheap = VerifyPrices(lambda q: step * (1 + 0.05 * (q - 1)))  # 5 % dearer per token

    good, bad, none = ([1, 2, 3, 4], 3), ([5, 6, 7], 2), ([], 0)
    chosen = best_round([good, none], book, cheap, 2 / step, 1.05, 1.0)
    assert chosen is not None and chosen.q == 5 and chosen.drafts == [[1, 2, 3, 4], []]
    assert best_round([bad, none], book, cheap, 2 / step, 1.05, 1.0) is None
    assert best_round([none, none], book, cheap, 2 / step, 1.05, 1.0) is None

    dear = VerifyPrices(lambda q: step * (1 + 0.9 * (q - 1)))  # a CPU's batched verify

    assert best_round([good, none], book, dear, 2 / step, 1.05, 1.0) is None
    # a subnet predicted faster than the copies: no copies
    assert best_round([good, none], book, cheap, 10 / step, 1.05, 1.0) is None


def test_a_ragged_verify_lets_the_rows_with_good_copies_draft_alone():
    """Where each verified token costs a third of a step, a padded round makes every row pay
    for the longest copy; a ragged one lets the row whose copies are kept draft alone,
    and not the rows whose copies fail, and beats plain decoding where padding did not."""
    book = CopyBook()
    for _ in range(50):
        book.record(3, 10, 9)
        book.record(2, 10, 0)
    step = 0.05

    def per_token(q):
        return step * (1 + 0.3 * (q - 1))

    good, bad = ([1, 2, 3, 4], 3), ([5, 6, 7], 2)
    batch = [good] + [bad] * 7
    plain = 8 / step
    assert best_round(batch, book, VerifyPrices(per_token), plain, 1.05, 1.0) is None
    chosen = best_round(batch, book, VerifyPrices(per_token, per_token), plain, 1.05, 1.0)
    assert chosen is not None and chosen.ragged and chosen.q == 5
    assert chosen.drafts == [[1, 2, 3, 4]] + [[]] * 7 and chosen.tokens == 12
    # every row's copy equally good: no padding to save, the padded verify (priced the same)
    even = best_round([good] * 8, book, VerifyPrices(per_token, per_token), plain, 1.05, 1.0)
    assert even is not None and not even.ragged and even.tokens == 8 * even.q


class FlatPrices:
    """Every verify costs a step: copies always price at least as well as plain decoding."""

    def verify_time(self, q: int, n: int) -> float:
        return 1.0


class Priced(Selector):
    """Plain decoding, with prices for copied drafts."""

    def plan(self, model, batch) -> Plan:
        return Plan(frozenset(), 0)

    def round_prices(self, batch: int):
        return FlatPrices()


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9,
                                                                       seed=5)],
                         ids=["greedy", "coupled"])
def test_copies_right_wrong_or_partly_right_keep_plain_decodings_tokens(engine_model,
                                                                        sampling):
    model = engine_model("llama-gqa")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 200, (n,), generator=g).tolist() for n in (9, 30, 17, 25)]
    config = GenerationConfig(max_new_tokens=20, sampling=sampling, stop_at_eos=False)
    ar = [r.token_ids for r in generate(Autoregressive(), model, prompts, config)]
    strategy = SelfSpeculative(Priced(), tau_conf=0.0, name="copy",
                               copied=Given(copies_of(ar, model.cfg.vocab_size)))
    results = generate(strategy, model, prompts, config)
    assert [r.token_ids for r in results] == ar
    for i, r in enumerate(results):
        s = r.stats
        assert s.copied_drafted == s.drafted > 0
        case = CASES[i % 3]
        if case == "right":  # every copy kept: 5 tokens a verify
            assert s.copied_accepted == s.copied_drafted and s.rounds <= 5
        elif case == "wrong":  # none kept: one token a verify, as plain decoding
            assert s.copied_accepted == 0 and s.rounds == 19
        else:  # the first two of each copy of four
            assert 0 < s.copied_accepted < s.copied_drafted
    assert all("copy@4" in r.stats.plans for r in results)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9,
                                                                       seed=5)],
                         ids=["greedy", "coupled"])
def test_ragged_verifies_of_right_wrong_and_partly_right_copies_keep_ars_tokens(
        engine_model, sampling):
    """Over a paged cache each row verifies its own copies (engine/ragged.py): rows that copy
    well draft, rows whose copies fail stop, and every row's tokens are plain decoding's."""
    model = engine_model("llama-gqa")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 200, (n,), generator=g).tolist()
               for n in (9, 30, 17, 25, 12, 40)]
    config = GenerationConfig(max_new_tokens=24, sampling=sampling, stop_at_eos=False)
    paging = Paging(tokens=6 * 80, page=16)
    ar = [r.token_ids for r in generate(Autoregressive(), model, prompts, config,
                                        paging=paging)]
    strategy = SelfSpeculative(PerToken(), tau_conf=0.0, name="copy",
                               copied=ragged_copies(ar, model.cfg.vocab_size))
    results = generate(strategy, model, prompts, config, paging=paging)
    assert [r.token_ids for r in results] == ar
    assert ragged_rounds(results) > 0, "no ragged verify ran"
    right = [r.stats for i, r in enumerate(results) if CASES[i % 3] == "right"]
    wrong = [r.stats for i, r in enumerate(results) if CASES[i % 3] == "wrong"]
    assert all(s.copied_accepted == s.copied_drafted > 0 for s in right)
    assert all(s.copied_accepted == 0 for s in wrong)
    assert sum(s.copied_drafted for s in wrong) < sum(s.copied_drafted for s in right) / 2


def test_rejection_sampling_keeps_a_copy_with_the_models_probability(tiny):
    """A copy is a proposal of probability 1: kept with the target's probability, else the
    token is drawn from the target without it. The first NEW tokens fit the model's exact
    distribution, copies both kept and not."""
    cfg = SamplingConfig(temperature=1.0, seed=77, method="rejection")
    strategy = SelfSpeculative(Priced(), tau_conf=0.0, name="copy",
                               copied=Given(lambda rid, out: [3, 5, 2]))
    config = GenerationConfig(max_new_tokens=NEW, sampling=cfg, stop_at_eos=False)
    results = generate(strategy, tiny, [PROMPT] * 800, config, max_num_seqs=200)
    drafted = sum(r.stats.copied_drafted for r in results)
    kept = sum(r.stats.copied_accepted for r in results)
    assert drafted > 800 and 0 < kept < drafted
    assert_matches_exact([tuple(r.token_ids) for r in results],
                         exact_distribution(tiny, SamplingConfig(temperature=1.0)),
                         "copied drafts, rejection")


def test_the_index_finds_copies_of_the_prompt_and_the_tokens_stay_ars(smollm2,
                                                                       corpus_prompt):
    """The real index and a real model over a passage given twice, the second time cut
    short: the model copies the rest, the copies are drafted and kept, and the tokens are
    plain decoding's."""
    passage = corpus_prompt[:120]
    prompts = [passage + passage[:30], corpus_prompt[:60]]
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    model = smollm2.model
    ar = [r.token_ids for r in generate(Autoregressive(), model, prompts, config)]
    copied = CopiedDrafts(min_gain=1.0, noise_z=0.0)
    strategy = SelfSpeculative(Priced(), tau_conf=0.0, name="copy", copied=copied)
    results = generate(strategy, model, prompts, config)
    assert [r.token_ids for r in results] == ar
    first = results[0].stats
    assert first.copied_accepted > 12 and first.rounds < 12  # the copied passage
    assert sum(copied.book.kept.values()) == sum(r.stats.copied_accepted for r in results)


def test_a_copy_not_drafted_is_judged_by_the_tokens_the_row_commits():
    """Where the price forbids copies (at the prior's lower bound, say, in a batch), each
    row's copy is judged later against what plain decoding committed, as a verify would have
    judged it: the book learns at no cost, and then copies pay."""
    row = type("Row", (), {"rid": 0, "prompt": [1, 2, 3, 4, 9, 1, 2], "out": []})()
    copies = CopiedDrafts(min_gain=1.05, noise_z=1.0)
    never = 1e9  # a rival no copy beats
    flat = VerifyPrices(lambda q: 1.0)
    assert copies.plan([row], [8], flat, never) is None
    assert copies.shadows[0].tokens[:3] == [3, 4, 9] and copies.book.drafted == 0
    row.out = [3, 4]  # committed so far agrees: not yet decided
    copies.plan([row], [8], flat, never)
    assert copies.book.drafted == 0
    row.out = [3, 4, 9, 7]  # (1, 2) matched: (3, 4, 9, 1, 2) proposed, 3 kept, the 4th judged
    copies.plan([row], [8], flat, never)
    assert (copies.book.judged, copies.book.kept) == ({2: 4}, {2: 3})
    copies.retire(0)
    assert not copies.shadows
