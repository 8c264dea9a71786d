"""The layout of a one-op block's float16 weights on this CPU: named by the setting, or
measured once beside the packed kernels' choices and read back; and the timed chain
the same bit for bit in either layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.engine import InferenceSession

from gpt2_max.layers import lines_choice
from gpt2_max.layers.lines_choice import KEY, LINES_ENV, Layout, float16_lines, layout
from gpt2_max.settings import settings

pytestmark = pytest.mark.tier("unit")


@pytest.fixture
def fresh(measured_afresh):
    return measured_afresh(LINES_ENV, layout)


def test_a_named_layout_is_taken_without_measuring(fresh, monkeypatch):
    monkeypatch.setattr(lines_choice, "measure", lambda: pytest.fail("measured"))
    for named, lines in (("1", True), ("0", False)):
        monkeypatch.setenv(LINES_ENV, named)
        layout.cache_clear()
        settings.cache_clear()
        assert float16_lines() is lines
        assert LINES_ENV in layout().why


def test_a_measurement_is_kept_beside_the_kernels_and_read_back(fresh, monkeypatch):
    fresh.write_text(json.dumps({"q4_k": {"kernel": "max"}}))
    measured = []

    def measure():
        measured.append(1)
        return lines_choice.pick({"rows": 9.0, "lines": 8.0})

    monkeypatch.setattr(lines_choice, "measure", measure)
    assert float16_lines()
    kept = json.loads(fresh.read_text())
    assert kept["q4_k"] == {"kernel": "max"} and kept[KEY]["lines"] is True
    layout.cache_clear()  # a later start: the file answers
    assert float16_lines() and measured == [1]


@pytest.mark.parametrize(("rows", "lines", "held"), [
    (9.0, 8.0, True),  # lines faster by more than the margin
    (9.0, 8.9, False),  # level within it: the file's row-major layout, no copy
    (8.0, 9.0, False),
])
def test_lines_are_taken_only_where_faster_by_the_margin(rows, lines, held):
    picked = lines_choice.pick({"rows": rows, "lines": lines}, busy=0.05)
    assert picked.lines is held and picked.busy == 0.05
    assert f"{rows:.2f} ms row-major" in picked.why


@pytest.mark.tier("model")
def test_the_measurement_times_both_layouts_whose_chains_agree_bit_for_bit():
    picked = lines_choice.measure(rounds=1)
    assert isinstance(picked, Layout) and set(picked.ms) == set(lines_choice.LAYOUTS)
    assert all(ms > 0 for ms in picked.ms.values()) and 0 <= picked.busy < 1
    assert picked.lines is (picked.ms["lines"] * lines_choice.MARGIN < picked.ms["rows"])
    # The same chain in either layout (graphs MAX compiled for the measurement).
    rng = np.random.default_rng(1)
    d, ff = lines_choice.D, lines_choice.FF
    pair = [(rng.standard_normal(s, np.float32) / 30).astype(np.float16)
            for s in ((ff, d), (d, ff))]
    x = Buffer.from_numpy(rng.standard_normal((3, d), np.float32))
    session = InferenceSession(devices=[CPU()])
    out = {}
    for lined in (False, True):
        weights = [lines_choice.held(pair[i % 2], lined) for i in range(2 * lines_choice.LAYERS)]
        model = session.load(lines_choice.chain(lined))
        out[lined] = model.execute(x, *map(Buffer.from_numpy, weights))[0].to_numpy()
    assert np.isfinite(out[False]).all() and np.abs(out[False]).max() > 0
    np.testing.assert_array_equal(out[True], out[False])
