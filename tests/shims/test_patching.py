"""A hook after a class's `__init__`, installed once however often it is asked."""

from __future__ import annotations

import pytest

from gpt2_max.shims.patching import after_init

pytestmark = pytest.mark.tier("unit")


def test_the_hook_sees_the_built_object_once_per_object():
    class Built:
        def __init__(self, value: int) -> None:
            self.value = value

    seen: list[int] = []
    after_init(Built, "hooked", lambda obj: seen.append(obj.value))
    after_init(Built, "hooked", lambda obj: seen.append(-obj.value))  # already patched
    assert Built(3).value == 3 and Built(value=4).value == 4
    assert seen == [3, 4]
