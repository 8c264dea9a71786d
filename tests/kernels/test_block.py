"""The one-op GPT-2 block against float64 NumPy over a random paged cache.

A step of up to `SKINNY_MAX_ROWS` rows runs the block in one parallel region with
barriers between its stages, a longer one stage by stage (`mojo/block.mojo`): each
batch below is one of the two, with float32 and float16 weights, and with GGUF blocks,
each projection of its own type, against their dequantized values. The op must
also leave the step's keys and values in the cache where MAX's own stores put them,
since the next step's attention (the op's or MAX's) reads them there.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

from gpt2_max import kernels
from gpt2_max.gguf.quants import quantize
from tests.kernels.test_attention import LAYER, PAGE, cache_inputs, cache_types, paged_cache
from tests.kernels.test_attention import reference as attention_reference

pytestmark = pytest.mark.tier("model")

EPS = 1e-5
BATCHES = {
    "decode (one region)": [(80, 1), (0, 1), (30, 0), (5, 7)],
    "one decode row (its keys shared by the tasks)": [(80, 1)],
    "one first token (a share with no key)": [(0, 1)],
    "prefill (stage by stage)": [(0, 37), (45, 20), (80, 1)],
}
"""(cached tokens, rows this step) per sequence."""
assert sum(r for _, r in BATCHES["decode (one region)"]) <= kernels.SKINNY_MAX_ROWS
assert sum(r for _, r in BATCHES["prefill (stage by stage)"]) > kernels.SKINNY_MAX_ROWS

class Shape(NamedTuple):
    hidden: int
    heads: int
    ff: int


FLOAT = Shape(hidden=128, heads=2, ff=512)
PACKED = Shape(hidden=256, heads=4, ff=1024)
"""Block shapes: a packed one's rows hold whole blocks of 256 values."""
MIXES = {
    "q4_k_m's types": (("q5_k", "q4_k", "q4_k", "q6_k"), PACKED),
    "32-value types, a last chunk part-full": (
        ("q8_0", "q5_0", "q4_0", "q5_1"), PACKED._replace(ff=1056)
    ),
}
"""Packed blocks: each projection (c_attn, c_proj, c_fc, mlp_proj) of its own type, as
a llama-quantize file mixes them, and the block's shape (an MLP of 1056 ends its c_fc
output in half a chunk of the kernel's 64 rows, which a residual or GELU must finish)."""


def projections(shape) -> dict[str, tuple[int, int]]:
    return {"c_attn": (3 * shape.hidden, shape.hidden), "c_proj": (shape.hidden, shape.hidden),
            "c_fc": (shape.ff, shape.hidden), "mlp_proj": (shape.hidden, shape.ff)}


@functools.cache
def block_op(shape, weight_dtype: DType, encodings: tuple, dot: str, scale: float,
             lined: bool = False):
    cpu = DeviceRef.CPU()
    head_dim = shape.hidden // shape.heads
    vector = [TensorType(DType.float32, [shape.hidden], cpu)] * 2
    types = [TensorType(DType.float32, ["tokens", shape.hidden], cpu), *vector]
    for i, (out, inp) in enumerate(projections(shape).values()):
        width = [f"bytes_{i}"] if encodings[i] else [inp]
        types += [TensorType(weight_dtype, [out, *width], cpu),
                  TensorType(DType.float32, [out], cpu)]
    types[7:7] = vector  # ln_2 after the attention's two projections
    types += cache_types(shape.heads, head_dim)
    name = "_".join(e or str(weight_dtype) for e in encodings)
    with Graph(f"block_{name}_{dot}{'_lined' * lined}", input_types=types) as graph:
        v = [value.tensor if i != 14 else value.buffer for i, value in enumerate(graph.inputs)]
        x, g1, b1, w_qkv, b_qkv, w_o, b_o, g2, b2, w_fc, b_fc, w_p, b_p = v[:13]
        offsets, blocks, stride, lengths, lut, layer = v[13:]
        cache = SimpleNamespace(
            kv_blocks=blocks, page_stride=stride, cache_lengths=lengths, lookup_table=lut,
        )
        graph.output(kernels.decoder_block(
            x, (g1, b1, EPS), (w_qkv, b_qkv), (w_o, b_o), (g2, b2), (w_fc, b_fc),
            (w_p, b_p), offsets, cache, layer, scale, head_dim,
            encodings=encodings, dot=dot, lined=lined,
        ))
    return InferenceSession(devices=[CPU()]).load(graph)


def layer_norm(x, g, b):
    mean = x.mean(axis=1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * g + b


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def run_block(batch, shape, weights, stored, encodings=(None,) * 4, dot="auto", lined=False):
    """The op on a random step of `batch` over a random paged cache, with `stored`
    (`[out, in]` arrays, or packed blocks) as the projections' weights; and the float64
    reference over `weights` (their values), the block's output and the cache after."""
    rng = np.random.default_rng(list(BATCHES).index(batch))
    head_dim = shape.hidden // shape.heads
    blocks, cached, offsets, lut = paged_cache(BATCHES[batch], shape.heads, head_dim, rng)
    tokens = int(offsets[-1])
    x = rng.standard_normal((tokens, shape.hidden), np.float32)
    ln = [(1 + 0.1 * rng.standard_normal(shape.hidden, np.float32),
           0.1 * rng.standard_normal(shape.hidden, np.float32)) for _ in range(2)]
    biases = {name: 0.1 * rng.standard_normal(dims[0], np.float32)
              for name, dims in projections(shape).items()}
    scale = 1 / np.sqrt(head_dim)
    arrays = [x, *ln[0], stored["c_attn"], biases["c_attn"], stored["c_proj"],
              biases["c_proj"], *ln[1], stored["c_fc"], biases["c_fc"], stored["mlp_proj"],
              biases["mlp_proj"]]
    dtype = DType.from_numpy(stored["c_attn"].dtype)
    cache = Buffer.from_numpy(blocks.copy())
    got = block_op(shape, dtype, tuple(encodings), dot, float(scale), lined).execute(
        *(Buffer.from_numpy(a) for a in arrays), *cache_inputs(offsets, cache, cached, lut)
    )[0].to_numpy()

    def linear(h, name):
        return h @ weights[name].astype(np.float64).T + biases[name]

    x64 = x.astype(np.float64)
    qkv = linear(layer_norm(x64, *ln[0]), "c_attn")
    q, k, v = np.split(qkv, 3, axis=1)
    expected_cache = blocks.copy()
    for b in range(len(cached)):
        pos = cached[b] + np.arange(offsets[b + 1] - offsets[b])
        rows = slice(offsets[b], offsets[b + 1])
        page, slot = lut[b, pos // PAGE], pos % PAGE
        expected_cache[page, 0, LAYER, slot] = k[rows].reshape(-1, shape.heads, head_dim)
        expected_cache[page, 1, LAYER, slot] = v[rows].reshape(-1, shape.heads, head_dim)
    attn = attention_reference(
        q.reshape(tokens, shape.heads, head_dim), offsets, expected_cache, cached, lut, scale
    ).reshape(tokens, shape.hidden)
    h = x64 + linear(attn, "c_proj")
    y = h + linear(gelu_tanh(linear(layer_norm(h, *ln[1]), "c_fc")), "mlp_proj")
    return SimpleNamespace(
        x=x64, got=got, y=y, cache=cache.to_numpy(), expected_cache=expected_cache
    )


def float_weights(weight_dtype: DType) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(99)
    return {
        name: (rng.standard_normal(shape, np.float32) / np.sqrt(shape[1]))
        .astype(weight_dtype.to_numpy())
        for name, shape in projections(FLOAT).items()
    }


@pytest.mark.parametrize("weight_dtype", [DType.float32, DType.float16], ids=str)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_block_matches_numpy(batch, weight_dtype):
    weights = float_weights(weight_dtype)
    out = run_block(batch, FLOAT, weights, weights)
    np.testing.assert_allclose(out.cache, out.expected_cache, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.got, out.y, atol=2e-4, rtol=0)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_a_float16_block_in_lines_gives_the_row_major_blocks_bits(batch):
    """Float16 weights held in lines (`kernels.lines`, as `FastLayers.prepare` holds a
    fused block's) are summed in the same order as row-major ones: the same output and
    cache bit for bit, at decode and prefill sizes."""
    weights = float_weights(DType.float16)
    rows = run_block(batch, FLOAT, weights, weights)
    lined = run_block(batch, FLOAT, weights, {n: kernels.lines(w) for n, w in weights.items()},
                      lined=True)
    assert not np.array_equal(kernels.lines(weights["c_fc"]), weights["c_fc"])
    np.testing.assert_array_equal(lined.got, rows.got)
    np.testing.assert_array_equal(lined.cache, rows.cache)
    np.testing.assert_allclose(lined.got, lined.y, atol=2e-4, rtol=0)


def packed_weights(mix: tuple[str, ...], shape: Shape):
    """Random weights in `mix`'s types: their values, and their blocks as the packed
    kernel reads them (`kernels.interleave`)."""
    rng = np.random.default_rng(7)
    values, stored = {}, {}
    for encoding, (name, dims) in zip(mix, projections(shape).items(), strict=True):
        qtype = GGMLQuantizationType[encoding.upper()]
        blocks = quantize(rng.standard_normal(dims, np.float32) / np.sqrt(dims[1]), qtype)
        values[name] = quants.dequantize(blocks, qtype)
        stored[name] = kernels.interleave(encoding, blocks)
    return values, stored


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_packed_block_matches_numpy_on_dequantized_weights(batch, mix):
    """Packed projections, each its own type, through the packed kernel's float32
    arithmetic: the block's value on the dequantized weights, as for float weights."""
    types, shape = MIXES[mix]
    values, stored = packed_weights(types, shape)
    out = run_block(batch, shape, values, stored, types, dot="float32")
    np.testing.assert_allclose(out.cache, out.expected_cache, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.got, out.y, atol=3e-4, rtol=0)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_packed_block_rounds_x_as_the_packed_ops_do(batch):
    """The arithmetic the model runs ("auto": x rounded to int8 per block on a CPU that
    multiplies bytes) stays within what that rounding adds: far under what a misplaced
    residual, GELU or weight group would (each changes the block's output by its own
    size)."""
    types, shape = MIXES["q4_k_m's types"]
    values, stored = packed_weights(types, shape)
    out = run_block(batch, shape, values, stored, types, dot="auto")
    change = np.linalg.norm(out.y - out.x)
    assert np.linalg.norm(out.got - out.y) <= 0.02 * change
    np.testing.assert_allclose(out.cache, out.expected_cache, atol=1e-3, rtol=0)


def test_a_block_is_all_float_or_all_packed():
    with pytest.raises(ValueError, match="all float or all packed"):
        kernels.decoder_block(*[None] * 12, encodings=("q4_k", None, None, None))
