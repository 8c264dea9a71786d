"""`layers.quantized.repack`: each packed weight in its kernel's layout, still saying
which block type it is."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from gpt2_max import kernels
from gpt2_max.gguf.quants import quantize
from gpt2_max.layers.quantized import repack
from gpt2_max.weights.plan import block_type, packed_weight


@pytest.mark.tier("unit")
@pytest.mark.parametrize("kind", ["q5_0", "q5_1", "q8_0"])
def test_repacked_weights_keep_their_block_type(kind):
    """The types MAX's `QuantizationEncoding` does not name travel as `BlockWeightData`;
    their regrouped copy must too, or a reader of the repacked state (the benchmarks'
    projection chain) takes its bytes for float weights."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal((37, 64), dtype=np.float32)  # two groups of 16 and a tail
    blocks = quantize(values, GGMLQuantizationType[kind.upper()])
    held = repack({"w": packed_weight(blocks, "w", kind)})["w"]
    assert block_type(held) == kind
    np.testing.assert_array_equal(np.asarray(held.data), kernels.interleave(kind, blocks))
    assert not np.array_equal(np.asarray(held.data), blocks)
