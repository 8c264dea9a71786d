"""The kernel each packed type gets on this CPU: named by the setting, or measured once
and read back; and both kernels exact on every type MAX's covers, whichever wins here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from max.driver import CPU, Buffer
from max.engine import InferenceSession

from gpt2_max.encodings import BLOCK_FLAGS
from gpt2_max.gguf.quants import quantize
from gpt2_max.layers import kernel_choice
from gpt2_max.layers.kernel_choice import KERNEL_ENV, Choice, choice, uses_max_kernel
from gpt2_max.settings import settings
from tests.kernels.test_kquant import float_atol, int8_atol

pytestmark = pytest.mark.tier("unit")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No setting, an empty cache file of this test's own, and no choice remembered."""
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.setattr(kernel_choice, "cache_file", lambda: tmp_path / "choices.json")
    choice.cache_clear()
    yield tmp_path / "choices.json"
    choice.cache_clear()


def test_a_named_kernel_is_taken_without_measuring(fresh, monkeypatch):
    monkeypatch.setattr(kernel_choice, "measure", lambda e: pytest.fail("measured"))
    for named, on_max in (("max", True), ("package", False)):
        monkeypatch.setenv(KERNEL_ENV, named)
        choice.cache_clear()
        settings.cache_clear()
        assert uses_max_kernel("q6_k") is on_max
        assert KERNEL_ENV in choice("q6_k").why


def test_types_max_has_no_kernel_for_go_to_the_package_unmeasured(fresh, monkeypatch):
    monkeypatch.setattr(kernel_choice, "measure", lambda e: pytest.fail("measured"))
    assert not any(uses_max_kernel(t) for t in ("q5_k", "q5_0", "q5_1", "q8_0"))


def test_a_measurement_is_kept_per_type_and_read_back_by_later_starts(fresh, monkeypatch):
    measured = []

    def measure(encoding):
        measured.append(encoding)
        return Choice("package" if encoding == "q6_k" else "max", {}, "timed")

    monkeypatch.setattr(kernel_choice, "measure", measure)
    assert not uses_max_kernel("q6_k")
    assert uses_max_kernel("q4_k")
    assert measured == ["q6_k", "q4_k"]
    assert json.loads(fresh.read_text())["q6_k"]["kernel"] == "package"
    choice.cache_clear()  # a later start: the file answers
    assert not uses_max_kernel("q6_k") and uses_max_kernel("q4_k")
    assert measured == ["q6_k", "q4_k"]


def test_a_draft_takes_the_faster_decode_step_and_a_named_kernel_for_both(fresh, monkeypatch):
    """A draft's one-row steps weigh the decode figures alone: MAX's kernel serves the
    request sooner here, the package's steps one row faster by more than the margin."""
    ms = {"max": {"decode": 5.4, "prefill": 35.0}, "package": {"decode": 4.8, "prefill": 100.0}}
    monkeypatch.setattr(kernel_choice, "measure", lambda e: Choice("max", ms, "timed"))
    assert uses_max_kernel("q4_0") and not uses_max_kernel("q4_0", "decode")
    assert "one-row steps: package's kernel" in choice("q4_0").describe("q4_0", "decode")
    near = {"max": {"decode": 5.0, "prefill": 35.0}, "package": {"decode": 4.8, "prefill": 99.0}}
    assert Choice("max", near, "timed").kernel_for("decode") == "max"  # within the margin
    monkeypatch.setenv(KERNEL_ENV, "max")
    choice.cache_clear()
    settings.cache_clear()
    assert uses_max_kernel("q4_0", "decode")


@pytest.mark.tier("model")
def test_the_measurement_picks_the_kernel_that_serves_the_request_sooner():
    picked = kernel_choice.measure("q4_0", rounds=1)
    cost = {
        k: kernel_choice.REQUEST[1] * ms["decode"]
        + kernel_choice.REQUEST[0] / kernel_choice.PREFILL_ROWS * ms["prefill"]
        for k, ms in picked.ms.items()
    }
    assert set(cost) == {"max", "package"} and all(c > 0 for c in cost.values())
    package_wins = cost["package"] * kernel_choice.MARGIN < cost["max"]
    assert picked.kernel == ("package" if package_wins else "max")
    assert "measured" in picked.why


@pytest.mark.tier("model")
@pytest.mark.parametrize("encoding", sorted(BLOCK_FLAGS))
@pytest.mark.parametrize("kernel", kernel_choice.KERNELS)
def test_either_kernel_matches_numpy_on_dequantized_weights(encoding, kernel):
    """Both kernels serve these types on some CPU, so both are checked on every CPU,
    against one int8 rounding of x per block (MAX's; the package's rounds finer)."""
    qtype = GGMLQuantizationType[encoding.upper()]
    rng = np.random.default_rng(11)
    blocks = quantize(rng.standard_normal((kernel_choice.FF, kernel_choice.D), np.float32), qtype)
    w = quants.dequantize(blocks, qtype).astype(np.float64)
    [held] = kernel_choice.held(encoding, kernel, [blocks])
    session = InferenceSession(devices=[CPU()])
    model = session.load(kernel_choice.chain(encoding, kernel, [held]))
    for m in (1, 5, 64):
        x = rng.standard_normal((m, kernel_choice.D), dtype=np.float32)
        got = model.execute(Buffer.from_numpy(x), Buffer.from_numpy(held))[0].to_numpy()
        exact = x.astype(np.float64) @ w.T
        block = 32 if encoding == "q4_0" else 256
        atol = float_atol(kernel_choice.D) + int8_atol(x, w, block)
        assert np.all(np.abs(got - exact) <= atol), f"rows {m}"
