"""The skinny matmul kernels against float64 NumPy, on shapes that exercise every tail."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

from gpt2_max import kernels

ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 64, 131)
"""Every register-tile height, full tiles plus each remainder, more rows than a tile, and
more than one pass of rows (a prefill through float16 weights), whole and with a tail."""
SHAPES = ((768, 2304), (17, 1), (33, 5), (100, 37), (3072, 768), (16, 4))
"""(K, N): multiples of the vector width and of the row block, and neither."""
WEIGHT_DTYPES = {DType.float32: np.float32, DType.float16: np.float16}
"""Weight types the kernel reads; activations, bias and output are float32."""


@pytest.fixture(scope="module", params=list(WEIGHT_DTYPES), ids=str)
def ops(request):
    """Both ops for one weight dtype, compiled once over symbolic shapes."""
    cpu = DeviceRef.CPU()
    x = TensorType(DType.float32, ["m", "k"], cpu)
    w = TensorType(request.param, ["n", "k"], cpu)
    b = TensorType(DType.float32, ["n"], cpu)
    with Graph("skinny_linear", input_types=[x, w, b]) as linear:
        linear.output(kernels.skinny_linear(*(v.tensor for v in linear.inputs)))
    with Graph("skinny_matmul", input_types=[x, w]) as matmul:
        matmul.output(kernels.skinny_matmul(*(v.tensor for v in matmul.inputs)))
    session = InferenceSession(devices=[CPU()])
    return WEIGHT_DTYPES[request.param], session.load(linear), session.load(matmul)


@pytest.mark.parametrize("k, n", SHAPES)
def test_matches_numpy(ops, k, n):
    weight_dtype, linear, matmul = ops
    rng = np.random.default_rng(k * 1000 + n)
    # The reference multiplies the weights as stored (rounded to float16 where they are).
    w = rng.standard_normal((n, k), dtype=np.float32).astype(weight_dtype)
    b = rng.standard_normal(n, dtype=np.float32)
    for m in ROWS:
        x = rng.standard_normal((m, k), dtype=np.float32)
        exact = x.astype(np.float64) @ w.T.astype(np.float64)
        # float32 accumulation over k terms of unit variance: error grows like sqrt(k).
        atol = 1e-5 * np.sqrt(k) * 4
        got = matmul.execute(Buffer.from_numpy(x), Buffer.from_numpy(w))[0].to_numpy()
        np.testing.assert_allclose(got, exact, atol=atol, rtol=0, err_msg=f"matmul m={m}")
        got = linear.execute(*map(Buffer.from_numpy, (x, w, b)))[0].to_numpy()
        np.testing.assert_allclose(got, exact + b, atol=atol, rtol=0, err_msg=f"linear m={m}")
