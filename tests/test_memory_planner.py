"""How much of the memory left the KV cache takes when a room takes some beside it."""

from __future__ import annotations

import pytest

from gpt2_max.extensions import Beside
from gpt2_max.memory_planner import cache_share

pytestmark = pytest.mark.tier("unit")


def test_with_nothing_beside_it_the_cache_may_take_all_that_is_left():
    assert cache_share(10_000, 100, Beside()) == 10_000


@pytest.mark.parametrize("beside", [Beside(1_050, 50), Beside(0, 100), Beside(9_000, 1)])
def test_the_cache_takes_the_most_whole_pages_that_leave_the_room_its_share(beside):
    share = cache_share(10_000, 100, beside)
    pages, rest = divmod(share, 100)
    assert rest == 0
    used = beside.fixed + pages * (100 + beside.per_page)
    assert used <= 10_000 < used + 100 + beside.per_page


def test_a_room_larger_than_what_is_left_leaves_the_cache_nothing():
    assert cache_share(10_000, 100, Beside(20_000, 10)) == 0
