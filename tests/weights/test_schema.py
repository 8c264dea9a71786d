"""`schema.check_finite`: a parameter holding a NaN or an infinity is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from max.graph.weights import WeightData

from gpt2_max.weights import schema
from gpt2_max.weights.schema import CheckpointError, check_finite

pytestmark = pytest.mark.tier("unit")


def weights(**arrays: np.ndarray) -> dict[str, WeightData]:
    return {name: WeightData.from_numpy(array, name) for name, array in arrays.items()}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bad, counts", [
    (np.nan, "1 NaN and 0 infinite"), (-np.inf, "0 NaN and 1 infinite"),
])
def test_a_parameter_with_a_nan_or_an_infinity_is_named(dtype, bad, counts):
    clean = np.ones((4, 8), dtype)
    damaged = clean.copy()
    damaged[2, 5] = bad
    with pytest.raises(CheckpointError, match=rf"tensor 'h.1.ln_2.weight' holds {counts} "
                                              r"value\(s\) of 32: the checkpoint is damaged"):
        check_finite(weights(**{"wte.weight": clean, "h.1.ln_2.weight": damaged}))


def test_finite_parameters_pass_even_where_their_sum_overflows():
    """The check sums each tensor first (no mask's memory): a sum past float32's range
    is looked at value by value."""
    check_finite(weights(big=np.full(8, 3e38, np.float32), half=np.full(8, 6e4, np.float16)))


def test_packed_blocks_are_not_read():
    check_finite(weights(packed=np.full(18, 255, np.uint8)))


def test_nothing_is_read_where_max_compiles_for_a_device_it_lacks(monkeypatch):
    """`max warm-cache --target`: MAX leaves the weights it casts at load uninitialized
    there, so their bytes (a NaN among them, at times) say nothing of the checkpoint."""
    damaged = weights(bias=np.array([0.0, np.nan], np.float16))
    monkeypatch.setattr(schema, "is_virtual_device_mode", lambda: True)
    check_finite(damaged)
    monkeypatch.setattr(schema, "is_virtual_device_mode", lambda: False)
    with pytest.raises(CheckpointError, match="'bias' holds 1 NaN"):
        check_finite(damaged)
