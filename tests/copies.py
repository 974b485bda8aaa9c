"""Copied drafts a test chooses (tests of speculation/lookup.py and of the ragged verify
over pages): per row, what plain decoding emits next, made right, wrong or partly right."""

from __future__ import annotations

from knapspec_dist.speculation.lookup import CopiedDrafts
from knapspec_dist.speculation.selfspec import Plan, Selector


class Given(CopiedDrafts):
    """Copies chosen by the test: ``propose(rid, out)`` -> the row's drafts."""

    def __init__(self, propose):
        super().__init__(min_gain=1.0, noise_z=0.0)
        self.propose = propose

    def proposals(self, rows, room):
        return [(self.propose(r.rid, r.out)[:space], 3) for r, space in zip(rows, room)]


CASES = ("right", "wrong", "partly")


def copies_of(ar_tokens: list[list[int]], vocab: int):
    """Row i's copy is case CASES[i % 3] of what plain decoding emits next."""

    def propose(rid: int, out: list[int]) -> list[int]:
        right = ar_tokens[rid][len(out):len(out) + 4]
        wrong = [(t + 1) % vocab for t in right]
        return {"right": right, "wrong": wrong, "partly": right[:2] + wrong[2:]}[
            CASES[rid % 3]]
    return propose


class PerToken(Selector):
    """Plain decoding; each verified token priced a third of a step more: a padded round
    makes every row pay for the longest copy, a ragged one only for its own."""

    def plan(self, model, batch) -> Plan:
        return Plan(frozenset(), 0)

    def round_prices(self, batch: int):
        return type("Prices", (), {"verify_time": lambda self, q, n: 1 + 0.3 * (q - 1)})()


MATCH = {"right": 3, "wrong": 2, "partly": 3}  # the book learns that 2-token matches fail


def ragged_copies(ar_tokens: list[list[int]], vocab: int) -> Given:
    """Copies of every case, a right or partly right one from a 3-token match and a wrong
    one from a 2-token match, so the book learns which rows' copies fail."""
    propose = copies_of(ar_tokens, vocab)
    copied = Given(propose)
    copied.proposals = lambda rows, room: [
        (propose(r.rid, r.out)[:space], MATCH[CASES[r.rid % 3]])
        for r, space in zip(rows, room)]
    return copied


def ragged_rounds(results) -> int:
    """Rounds of ragged verifies (plan ``copy@<=K``) over every row."""
    return sum(t.rounds for r in results for label, t in r.stats.plans.items()
               if label.startswith("copy@<="))
