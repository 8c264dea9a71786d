"""What the measured choices' tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpt2_max.layers import kernel_choice


@pytest.fixture
def measured_afresh(monkeypatch, tmp_path) -> Iterator[Callable[..., Path]]:
    """Starts a test as a CPU that never measured: `afresh(variable, remembered)` unsets
    the setting that would name the choice, clears the choice `remembered` this process
    (now and after the test), and gives the test a cache file of its own for what is
    measured (`kernel_choice.cache_file`, where the packed kernels' and the float16
    layout's measurements are kept), whose path it returns."""
    path = tmp_path / "choices.json"
    monkeypatch.setattr(kernel_choice, "cache_file", lambda: path)
    cleared = []

    def afresh(variable: str, remembered) -> Path:
        monkeypatch.delenv(variable, raising=False)
        remembered.cache_clear()
        cleared.append(remembered)
        return path

    yield afresh
    for remembered in cleared:
        remembered.cache_clear()
