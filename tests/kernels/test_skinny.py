"""The float linear ops against float64 NumPy, on shapes that exercise every tail: the
skinny kernel up to `SKINNY_MAX_ROWS` rows, MAX's tiled matmul past it (float32 weights)."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, ops

from gpt2_max import kernels
from gpt2_max.kernels import SKINNY_MAX_ROWS

pytestmark = pytest.mark.tier("model")

ROWS = (1, 2, 3, 4, 5, 7, 8, 9, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 64, 131)
"""Every register-tile height, full tiles plus each remainder, more rows than a tile, and
more than one pass of rows (a prefill through float16 weights), whole and with a tail;
either side of the switch to MAX's matmul for float32 weights."""
SHAPES = ((768, 2304), (17, 1), (33, 5), (100, 37), (3072, 768), (16, 4), (100, 151))
"""(K, N): multiples of the vector width and of the row block, and neither; N of many
chunks (`CHUNK_BLOCKS` blocks of rows each), and of several with a short last one and
rows past the last whole block."""
WEIGHT_DTYPES = {DType.float32: np.float32, DType.float16: np.float16}
"""Weight types the kernel reads; activations, bias and output are float32."""


@pytest.fixture(scope="module", params=list(WEIGHT_DTYPES), ids=str)
def linear_ops(request):
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
def test_matches_numpy(linear_ops, k, n):
    weight_dtype, linear, matmul = linear_ops
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


def test_many_rows_run_max_matmul():
    """Past `SKINNY_MAX_ROWS` rows a float32 op computes what MAX's own graph matmul does,
    bit for bit (same kernel, same summation order, the bias added as it stores), at
    prefill sizes and at odd ones; at decode sizes it still runs the skinny kernel, whose
    different summation order shows in the last bits."""
    cpu = DeviceRef.CPU()
    x = TensorType(DType.float32, ["m", "k"], cpu)
    w = TensorType(DType.float32, ["n", "k"], cpu)
    b = TensorType(DType.float32, ["n"], cpu)
    with Graph("ours", input_types=[x, w, b]) as ours:
        xv, wv, bv = (v.tensor for v in ours.inputs)
        ours.output(kernels.skinny_linear(xv, wv, bv), kernels.skinny_matmul(xv, wv))
    with Graph("max_matmul", input_types=[x, w, b]) as theirs:
        xv, wv, bv = (v.tensor for v in theirs.inputs)
        product = ops.matmul(xv, ops.transpose(wv, 0, 1))
        theirs.output(product + bv, product)
    session = InferenceSession(devices=[CPU()])
    ours, theirs = session.load(ours), session.load(theirs)
    rng = np.random.default_rng(7)
    for m, k, n in ((512, 768, 3072), (900, 3072, 768), (SKINNY_MAX_ROWS + 1, 33, 5),
                    (131, 100, 37), (SKINNY_MAX_ROWS, 768, 2304)):
        args = (rng.standard_normal((m, k), dtype=np.float32),
                rng.standard_normal((n, k), dtype=np.float32),
                rng.standard_normal(n, dtype=np.float32))
        got = [t.to_numpy() for t in ours.execute(*map(Buffer.from_numpy, args))]
        want = [t.to_numpy() for t in theirs.execute(*map(Buffer.from_numpy, args))]
        for name, g, e in zip(("linear", "matmul"), got, want, strict=True):
            if m > SKINNY_MAX_ROWS:
                np.testing.assert_array_equal(g, e, err_msg=f"{name} m={m} k={k} n={n}")
            else:
                assert not np.array_equal(g, e), f"{name} m={m}: the skinny kernel ran"
