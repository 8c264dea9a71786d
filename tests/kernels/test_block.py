"""The one-op GPT-2 block against float64 NumPy over a random paged cache.

A step of up to `SKINNY_MAX_ROWS` rows runs the block in one parallel region with
barriers between its stages, a longer one stage by stage (`mojo/block.mojo`): each
batch below is one of the two, with float32 and with float16 weights. The op must
also leave the step's keys and values in the cache where MAX's own stores put them,
since the next step's attention (the op's or MAX's) reads them there.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

from gpt2_max import kernels
from tests.kernels.test_attention import LAYER, PAGE, cache_inputs, cache_types, paged_cache
from tests.kernels.test_attention import reference as attention_reference

pytestmark = pytest.mark.tier("model")

HIDDEN, HEADS, FF, EPS = 128, 2, 512, 1e-5
HEAD_DIM = HIDDEN // HEADS
BATCHES = {
    "decode (one region)": [(80, 1), (0, 1), (30, 0), (5, 7)],
    "one decode row (its keys shared by the tasks)": [(80, 1)],
    "one first token (a share with no key)": [(0, 1)],
    "prefill (stage by stage)": [(0, 37), (45, 20), (80, 1)],
}
"""(cached tokens, rows this step) per sequence."""
assert sum(r for _, r in BATCHES["decode (one region)"]) <= kernels.SKINNY_MAX_ROWS
assert sum(r for _, r in BATCHES["prefill (stage by stage)"]) > kernels.SKINNY_MAX_ROWS

PROJECTIONS = {"c_attn": (3 * HIDDEN, HIDDEN), "c_proj": (HIDDEN, HIDDEN),
               "c_fc": (FF, HIDDEN), "mlp_proj": (HIDDEN, FF)}


@functools.cache
def block_op(weight_dtype: DType, scale: float):
    cpu = DeviceRef.CPU()
    vector = [TensorType(DType.float32, [HIDDEN], cpu)] * 2
    types = [TensorType(DType.float32, ["tokens", HIDDEN], cpu), *vector]
    for out, inp in PROJECTIONS.values():
        types += [TensorType(weight_dtype, [out, inp], cpu), TensorType(DType.float32, [out], cpu)]
    types[7:7] = vector  # ln_2 after the attention's two projections
    types += cache_types(HEADS, HEAD_DIM)
    with Graph(f"block_{weight_dtype}", input_types=types) as graph:
        v = [value.tensor if i != 14 else value.buffer for i, value in enumerate(graph.inputs)]
        x, g1, b1, w_qkv, b_qkv, w_o, b_o, g2, b2, w_fc, b_fc, w_p, b_p = v[:13]
        offsets, blocks, stride, lengths, lut, layer = v[13:]
        cache = SimpleNamespace(
            kv_blocks=blocks, page_stride=stride, cache_lengths=lengths, lookup_table=lut,
        )
        graph.output(kernels.decoder_block(
            x, (g1, b1, EPS), (w_qkv, b_qkv), (w_o, b_o), (g2, b2), (w_fc, b_fc),
            (w_p, b_p), offsets, cache, layer, scale, HEAD_DIM,
        ))
    return InferenceSession(devices=[CPU()]).load(graph)


def layer_norm(x, g, b):
    mean = x.mean(axis=1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * g + b


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("weight_dtype", [DType.float32, DType.float16], ids=str)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_block_matches_numpy(batch, weight_dtype):
    rng = np.random.default_rng(list(BATCHES).index(batch))
    blocks, cached, offsets, lut = paged_cache(BATCHES[batch], HEADS, HEAD_DIM, rng)
    tokens = int(offsets[-1])
    x = rng.standard_normal((tokens, HIDDEN), np.float32)
    ln = [(1 + 0.1 * rng.standard_normal(HIDDEN, np.float32),
           0.1 * rng.standard_normal(HIDDEN, np.float32)) for _ in range(2)]
    weights = {
        name: ((rng.standard_normal(shape, np.float32) / np.sqrt(shape[1]))
               .astype(weight_dtype.to_numpy()),
               0.1 * rng.standard_normal(shape[0], np.float32))
        for name, shape in PROJECTIONS.items()
    }
    scale = 1 / np.sqrt(HEAD_DIM)
    arrays = [x, *ln[0], *weights["c_attn"], *weights["c_proj"], *ln[1],
              *weights["c_fc"], *weights["mlp_proj"]]
    cache = Buffer.from_numpy(blocks.copy())
    got = block_op(weight_dtype, float(scale)).execute(
        *(Buffer.from_numpy(a) for a in arrays), *cache_inputs(offsets, cache, cached, lut)
    )[0].to_numpy()

    def linear(h, name):
        w, b = weights[name]
        return h @ w.astype(np.float64).T + b

    x64 = x.astype(np.float64)
    qkv = linear(layer_norm(x64, *ln[0]), "c_attn")
    q, k, v = np.split(qkv, 3, axis=1)
    expected_cache = blocks.copy()
    for b in range(len(cached)):
        pos = cached[b] + np.arange(offsets[b + 1] - offsets[b])
        rows = slice(offsets[b], offsets[b + 1])
        page, slot = lut[b, pos // PAGE], pos % PAGE
        expected_cache[page, 0, LAYER, slot] = k[rows].reshape(-1, HEADS, HEAD_DIM)
        expected_cache[page, 1, LAYER, slot] = v[rows].reshape(-1, HEADS, HEAD_DIM)
    attn = attention_reference(
        q.reshape(tokens, HEADS, HEAD_DIM), offsets, expected_cache, cached, lut, scale
    ).reshape(tokens, HIDDEN)
    h = x64 + linear(attn, "c_proj")
    y = h + linear(gelu_tanh(linear(layer_norm(h, *ln[1]), "c_fc")), "mlp_proj")

    np.testing.assert_allclose(cache.to_numpy(), expected_cache, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got, y, atol=2e-4, rtol=0)
