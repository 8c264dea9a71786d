"""The rule that picks a round's draft length: the most tokens a second, or none."""

from __future__ import annotations

import pytest

from gpt2_max.speculate.pace import PROBE_EVERY, Pace, tokens_a_round

pytestmark = pytest.mark.tier("unit")


def test_a_round_makes_the_expected_tokens() -> None:
    assert tokens_a_round(0.0, 4) == 1.0
    assert tokens_a_round(1.0, 4) == 5.0
    assert tokens_a_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def measured(kept_each: int, k: int, draft_s: float, check_s: float, rounds: int = 30) -> Pace:
    pace = Pace(most=8)
    for _ in range(rounds):
        pace.note(k, [kept_each], draft_s, check_s)
    return pace


def test_before_any_round_the_setting_drafts() -> None:
    assert Pace(most=6).tokens() == 6


def test_a_cheap_draft_that_is_always_kept_drafts_the_most() -> None:
    assert measured(kept_each=4, k=4, draft_s=0.002, check_s=0.05).tokens() == 8


def test_a_draft_kept_half_the_time_drafts_a_few() -> None:
    pace = measured(kept_each=1, k=4, draft_s=0.01, check_s=0.05)
    assert pace.alpha == pytest.approx(0.5)
    assert 1 <= pace.tokens() <= 3


def test_a_draft_never_kept_is_turned_off_and_probed() -> None:
    pace = measured(kept_each=0, k=4, draft_s=0.01, check_s=0.05)
    picks = [pace.tokens() for _ in range(2 * PROBE_EVERY)]
    assert picks.count(0) == 2 * PROBE_EVERY - 2
    assert picks[PROBE_EVERY - 1] == picks[-1] == 8


def test_a_steady_pace_drafts_the_most_whatever_it_pays() -> None:
    pace = measured(kept_each=0, k=4, draft_s=0.01, check_s=0.05)
    pace.steady = True
    assert pace.tokens() == 8
