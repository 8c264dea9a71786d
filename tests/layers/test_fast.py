"""`FastLayers.prepare`: a fused block's float16 weights go in lines, as its op reads
them, where lines are this CPU's layout (`lines_choice`); every other weight stays as
loaded."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from max.dtype import DType
from max.graph.weights import WeightData

from gpt2_max import kernels
from gpt2_max.layers import lines_choice
from gpt2_max.layers.fast import FastLayers
from gpt2_max.layers.lines_choice import LINES_ENV, Layout
from gpt2_max.settings import setting, settings
from gpt2_max.weights.plan import WeightPlan
from gpt2_max.weights.schema import PROJECTIONS

pytestmark = pytest.mark.tier("unit")


def half_state(hidden: int, inner: int | None = None) -> dict[str, WeightData]:
    """One block's float16 projections, a float16 token table (a tied head) and a
    float32 bias, as the GGUF adapter hands an F16 file's over."""
    rng = np.random.default_rng(0)
    inner = inner or 4 * hidden
    shapes = dict(zip(PROJECTIONS, ((3 * hidden, hidden), (hidden, hidden),
                                    (inner, hidden), (hidden, inner)), strict=True))
    arrays = {f"h.0.{p}.weight": rng.standard_normal(s).astype(np.float16)
              for p, s in shapes.items()}
    arrays["wte.weight"] = rng.standard_normal((50, hidden)).astype(np.float16)
    arrays["h.0.attn.c_attn.bias"] = rng.standard_normal(3 * hidden).astype(np.float32)
    return {name: WeightData.from_numpy(a, name) for name, a in arrays.items()}


def prepared(state: dict[str, WeightData], hidden: int) -> dict[str, np.ndarray]:
    config = SimpleNamespace(weights=WeightPlan.of(state), activation="gelu_tanh",
                             dtype=DType.float32)
    return {name: np.asarray(w.data) for name, w in FastLayers(config).prepare(state).items()}


@pytest.fixture
def layout(monkeypatch):
    """This CPU's float16 layout as a test names it (`GPT2_MAX_FLOAT16_LINES`), or unset;
    no layout remembered from another test."""

    def named(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(LINES_ENV, raising=False)
        else:
            monkeypatch.setenv(LINES_ENV, value)
        settings.cache_clear()
        lines_choice.layout.cache_clear()

    yield named
    lines_choice.layout.cache_clear()


def test_a_fused_blocks_float16_weights_go_in_lines_and_the_rest_as_loaded(layout):
    layout("1")
    state = half_state(64)
    out = prepared(state, 64)
    for name, weight in state.items():
        loaded = np.asarray(weight.data)
        if name.endswith(".weight") and name.startswith("h.0."):
            assert out[name].dtype == np.float16
            np.testing.assert_array_equal(out[name], kernels.lines(loaded))
            assert not np.array_equal(out[name], loaded)
        else:
            np.testing.assert_array_equal(out[name], loaded)  # the table the gather reads


def test_lines_hold_each_block_of_rows_a_line_of_each_in_turn():
    w = np.arange(9 * 64, dtype=np.float16).reshape(9, 64)
    held = kernels.lines(w)
    assert held.shape == w.shape
    flat = held[:8].reshape(-1)
    np.testing.assert_array_equal(flat[:32], w[0, :32])
    np.testing.assert_array_equal(flat[32:64], w[1, :32])
    np.testing.assert_array_equal(flat[128:160], w[0, 32:])
    np.testing.assert_array_equal(flat[256:288], w[4, :32])
    np.testing.assert_array_equal(held[8], w[8])  # past the last whole block: as it was
    with pytest.raises(ValueError, match="whole lines"):
        kernels.lines(np.zeros((4, 40), np.float16))


def test_where_row_major_streams_faster_every_weight_stays_as_loaded(layout, monkeypatch):
    """The layout this CPU measured decides, measured once, only for weights lines can
    hold; named row-major (`0`), nothing is measured."""
    measured = []

    def measure():
        measured.append(1)
        return Layout(False, {"rows": 1.0, "lines": 1.2}, "timed")

    monkeypatch.setattr(lines_choice, "measure", measure)
    monkeypatch.setattr(lines_choice, "kept", lambda key, what, take, kind: take())
    for named in (None, "0"):
        layout(named)
        state = half_state(64)
        out = prepared(state, 64)
        assert all(np.array_equal(out[n], np.asarray(w.data)) for n, w in state.items())
    assert measured == [1]
    layout(None)
    prepared(half_state(40), 40)  # rows of no whole lines: nothing to measure
    assert measured == [1]


def test_composed_blocks_and_part_lines_keep_their_weights_row_major(layout, monkeypatch):
    """Only a `FusedBlock`'s op reads lines: with blocks composed of modules
    (`GPT2_MAX_FUSE_BLOCKS=0`), or rows of no whole lines (a hidden size, or an
    `n_inner`), nothing changes."""
    layout("1")
    for hidden, inner in ((40, None), (64, 200)):
        odd = half_state(hidden, inner)
        out = prepared(odd, hidden)
        assert all(np.array_equal(out[n], np.asarray(w.data)) for n, w in odd.items())
    monkeypatch.setenv(setting("fuse_blocks").variable, "0")
    settings.cache_clear()
    try:
        state = half_state(64)
        out = prepared(state, 64)
        assert all(np.array_equal(out[n], np.asarray(w.data)) for n, w in state.items())
    finally:
        monkeypatch.delenv(setting("fuse_blocks").variable)
        settings.cache_clear()
