"""The packed-weight kernel against NumPy on the `gguf` package's dequantization.

Weights are quantized by `gpt2_max.gguf.quants` (ggml's byte layout) and read back
by `gguf.quants.dequantize`, an implementation independent of the kernel's: the
kernel must equal the float matmul over those weights up to float32 summation order,
or, where it rounds the activations to int8 (`dot="int8"`), up to what that rounding
can add.
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
from gpt2_max.encodings import KERNEL_TYPES, block_geometry
from gpt2_max.gguf.quants import quantize

pytestmark = pytest.mark.tier("model")

ROWS = (1, 2, 3, 4, 5, 6, 7, 16, 17, 64, 131)
"""Every register-tile height, more rows than a tile, and more than one pass of rows."""
SHAPES = ((768, 2304), (256, 1), (512, 37), (3072, 768))
"""(K, N): GPT-2's projections, one output, and an output count no task split divides."""
SMALL_BLOCK_SHAPES = ((32, 5), (96, 33))
"""The 32-value formats also take K that no 256-value block divides."""
K_QUANTS = ("q4_k", "q5_k", "q6_k")
"""The k-quants: a choice of float32 or int8 arithmetic (`kernels.DOTS`)."""
INT8_32 = ("q4_0", "q5_0", "q5_1", "q8_0")
"""The 32-value block types with an int8 path besides float32."""
ROUNDED = {"int8": 1, "int8x2": 254}
"""Dots whose results may carry int8 rounding of the activations, by how much finer
than one int8 step per block their rounding is ("int8x2" rounds the remainder again).
The every-shape test runs each, the served model "auto": `AUTO`'s on a CPU that
multiplies bytes (`kquant.dot_path`), float32 on one that does not."""
AUTO = {"q4_k": "int8", "q6_k": "int8", "q4_0": "int8"}
"""What "auto" rounds as, where not "int8x2": Q4_K, Q6_K and Q4_0 round x once, as
MAX's kernel and llama.cpp's do."""


def rounding(x: np.ndarray, w: np.ndarray, encoding: str, dot: str) -> np.ndarray | float:
    """What rounding x may add to x @ w.T on `encoding`'s int8 paths with `dot` ("auto"
    read as `AUTO` says; 0 for the exact ones)."""
    if encoding not in K_QUANTS + INT8_32 or dot not in (*ROUNDED, "auto"):
        return 0.0
    finer = ROUNDED[AUTO.get(encoding, "int8x2") if dot == "auto" else dot]
    return int8_atol(x, w, rounding_block(encoding)) / finer


DOTS = {
    encoding: ("float32", "int8", "int8x2") if encoding in K_QUANTS + INT8_32 else ("auto",)
    for encoding in sorted(KERNEL_TYPES)
}
"""The dots each type is checked with on every shape."""

CASES = [
    (encoding, dot, k, n)
    for encoding, dots in DOTS.items()
    for dot in dots
    for k, n in SHAPES + (SMALL_BLOCK_SHAPES if block_geometry(encoding)[0] == 32 else ())
]


def compiled_dots(encoding: str) -> tuple[str, ...]:
    """The dots the tests here run on `encoding`: its `DOTS`, and those the rounding
    and batching tests name."""
    named = (*ROUNDED, "auto") if encoding in K_QUANTS + INT8_32 else ("auto",)
    return DOTS[encoding] + tuple(d for d in named if d not in DOTS[encoding])


@functools.cache
def ops(encoding: str):
    """Both ops of every dot of one block type, compiled once over symbolic shapes,
    in one graph: a compile costs far more than a run of these sizes. Each dot reads
    an `x` of its own, so a run gives the dot asked for its rows and the others one
    row of zeros."""
    cpu = DeviceRef.CPU()
    dots = compiled_dots(encoding)
    w = TensorType(DType.uint8, ["n", "row_bytes"], cpu)
    b = TensorType(DType.float32, ["n"], cpu)
    xs = [TensorType(DType.float32, [f"m_{dot}", "k"], cpu) for dot in dots]
    with Graph(f"packed_{encoding}", input_types=[w, b, *xs]) as graph:
        w, b, *xs = (v.tensor for v in graph.inputs)
        graph.output(*(
            op for dot, x in zip(dots, xs, strict=True)
            for op in (kernels.packed_matmul(encoding, x, w, dot=dot),
                       kernels.packed_linear(encoding, x, w, b, dot=dot))
        ))
    return dots, InferenceSession(devices=[CPU()]).load(graph)


def float_atol(k: int) -> float:
    """float32 accumulation over k terms of about unit size: error grows like sqrt(k)."""
    return 1e-5 * np.sqrt(k) * 4


def int8_atol(x: np.ndarray, w: np.ndarray, block: int = 256) -> np.ndarray:
    """Six standard deviations of what rounding x to int8 per `block` values (step
    max |x| / 127 of the block: 256 for the k-quants, 32 for the 32-value types) adds to
    x @ w.T: each rounding error is about uniform over a step, independent of the
    others, [rows of x, rows of w]."""
    m, k = x.shape
    step = np.abs(x.reshape(m, k // block, block)).max(axis=-1) / 127
    weight = (w.reshape(w.shape[0], k // block, block) ** 2).sum(axis=-1)
    return 6 * np.sqrt(step**2 / 12 @ weight.T)


def rounding_block(encoding: str) -> int:
    """The values x is rounded over on the int8 paths: a block of the weights' type."""
    return block_geometry(encoding)[0]


def run(encoding: str, dot: str, x, blocks, b=None) -> tuple[np.ndarray, np.ndarray]:
    """`x @ W.T` and `x @ W.T + b` (b zero if not given) through the kernel with `dot`."""
    dots, model = ops(encoding)
    idle = np.zeros((1, x.shape[1]), dtype=np.float32)
    xs = [x if d == dot else idle for d in dots]
    b = np.zeros(blocks.shape[0], dtype=np.float32) if b is None else b
    held = kernels.interleave(encoding, blocks)
    out = model.execute(*map(Buffer.from_numpy, (held, b, *xs)))
    at = 2 * dots.index(dot)
    return out[at].to_numpy(), out[at + 1].to_numpy()


@pytest.mark.parametrize("encoding, dot, k, n", CASES)
def test_matches_numpy_on_dequantized_weights(encoding, dot, k, n):
    qtype = GGMLQuantizationType[encoding.upper()]
    rng = np.random.default_rng(k * 1000 + n)
    blocks = quantize(rng.standard_normal((n, k), dtype=np.float32), qtype)
    w = quants.dequantize(blocks, qtype).astype(np.float64)
    assert w.shape == (n, k)
    b = rng.standard_normal(n, dtype=np.float32)
    for m in ROWS:
        x = rng.standard_normal((m, k), dtype=np.float32)
        exact = x.astype(np.float64) @ w.T
        atol = float_atol(k) + rounding(x, w, encoding, dot)
        matmul, linear = run(encoding, dot, x, blocks, b)
        assert np.all(np.abs(matmul - exact) <= atol), f"matmul m={m}"
        assert np.all(np.abs(linear - exact - b) <= atol), f"linear m={m}"


@pytest.mark.parametrize("encoding", K_QUANTS + INT8_32)
def test_int8_rounds_each_block_of_x_on_its_own_scale(encoding):
    """Blocks of x 10^4 apart in size, against weights that are zero under the large
    ones: a scale per row (or per call) would round the small blocks with the large
    ones' step, far past their own bound. An all-zero block of x (step 0) adds nothing."""
    qtype = GGMLQuantizationType[encoding.upper()]
    rng = np.random.default_rng(5)
    k, n, m = 1024, 40, 3
    dense = rng.standard_normal((n, k), dtype=np.float32)
    dense[:, 512:768] = 0
    blocks = quantize(dense, qtype)
    w = quants.dequantize(blocks, qtype).astype(np.float64)
    x = rng.standard_normal((m, k), dtype=np.float32) * 1e-2
    x[:, 512:768] *= 1e4
    x[1, :256] = 0
    exact = x.astype(np.float64) @ w.T
    for dot in (*ROUNDED, "auto"):
        got, _ = run(encoding, dot, x, blocks)
        assert np.all(np.isfinite(got))
        bound = float_atol(k) * 1e-2 + rounding(x, w, encoding, dot)
        assert np.all(np.abs(got - exact) <= bound), dot


@pytest.mark.parametrize("encoding", sorted(KERNEL_TYPES))
def test_a_row_comes_out_the_same_whatever_it_is_batched_with(encoding):
    """The arithmetic the model runs ("auto") does not depend on the row count: rows
    multiplied alone equal the same rows inside a prefill-sized call, bit for bit, so
    batching never changes a request's result (int8 rounding is per row and block)."""
    qtype = GGMLQuantizationType[encoding.upper()]
    rng = np.random.default_rng(11)
    k, n = 768, 300
    blocks = quantize(rng.standard_normal((n, k), dtype=np.float32), qtype)
    b = rng.standard_normal(n, dtype=np.float32)
    x = rng.standard_normal((131, k), dtype=np.float32)
    together = run(encoding, "auto", x, blocks, b)
    for rows in (slice(0, 1), slice(5, 7), slice(64, 69), slice(128, 131)):
        alone = run(encoding, "auto", np.ascontiguousarray(x[rows]), blocks, b)
        for one, batched in zip(alone, together, strict=True):
            np.testing.assert_array_equal(one, batched[rows])
