"""The packed-weight kernel against NumPy on the `gguf` package's dequantization.

Weights are quantized by `tools.gguf_quants` (ggml's byte layout) and read back
by `gguf.quants.dequantize`, an implementation independent of the kernel's: the
kernel must equal the float matmul over those weights up to float32 summation order.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

from gpt2_max import kernels
from gpt2_max.tools.gguf_quants import quantize
from gpt2_max.weights.plan import KEPT_PACKED

ROWS = (1, 2, 3, 4, 5, 7, 16, 17, 64, 131)
"""Every register-tile height, more rows than a tile, and more than one pass of rows."""
SHAPES = ((768, 2304), (256, 1), (512, 37), (3072, 768))
"""(K, N): GPT-2's projections, one output, and an output count no task split divides."""
SMALL_BLOCK_SHAPES = ((32, 5), (96, 33))
"""The 32-value formats also take K that no 256-value block divides."""


CASES = [
    (encoding, k, n)
    for encoding in sorted(kernels.PACKED_TYPES)
    for k, n in SHAPES + (SMALL_BLOCK_SHAPES if encoding in ("q4_0", "q8_0") else ())
]


def test_every_type_kept_packed_has_a_kernel():
    assert KEPT_PACKED <= set(kernels.PACKED_TYPES)


@functools.cache
def ops(encoding: str):
    """Both ops for one block type, compiled once over symbolic shapes."""
    cpu = DeviceRef.CPU()
    x = TensorType(DType.float32, ["m", "k"], cpu)
    w = TensorType(DType.uint8, ["n", "row_bytes"], cpu)
    b = TensorType(DType.float32, ["n"], cpu)
    with Graph(f"packed_linear_{encoding}", input_types=[x, w, b]) as linear:
        linear.output(kernels.packed_linear(encoding, *(v.tensor for v in linear.inputs)))
    with Graph(f"packed_matmul_{encoding}", input_types=[x, w]) as matmul:
        matmul.output(kernels.packed_matmul(encoding, *(v.tensor for v in matmul.inputs)))
    session = InferenceSession(devices=[CPU()])
    return session.load(linear), session.load(matmul)


@pytest.mark.parametrize("encoding, k, n", CASES)
def test_matches_numpy_on_dequantized_weights(encoding, k, n):
    qtype = GGMLQuantizationType[encoding.upper()]
    linear, matmul = ops(encoding)
    rng = np.random.default_rng(k * 1000 + n)
    blocks = quantize(rng.standard_normal((n, k), dtype=np.float32), qtype)
    w = quants.dequantize(blocks, qtype).astype(np.float64)
    assert w.shape == (n, k)
    b = rng.standard_normal(n, dtype=np.float32)
    for m in ROWS:
        x = rng.standard_normal((m, k), dtype=np.float32)
        exact = x.astype(np.float64) @ w.T
        # float32 accumulation over k terms of about unit size: error grows like sqrt(k).
        atol = 1e-5 * np.sqrt(k) * 4
        got = matmul.execute(Buffer.from_numpy(x), Buffer.from_numpy(blocks))[0].to_numpy()
        np.testing.assert_allclose(got, exact, atol=atol, rtol=0, err_msg=f"matmul m={m}")
        got = linear.execute(*map(Buffer.from_numpy, (x, blocks, b)))[0].to_numpy()
        np.testing.assert_allclose(got, exact + b, atol=atol, rtol=0, err_msg=f"linear m={m}")
