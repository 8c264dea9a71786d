"""The paged-attention op against float64 NumPy on a random paged cache.

One ragged batch holds every kind of row the op serves: a whole prompt, a chunk of a
prompt behind cached tokens (chunked prefill, prefix-cache hits), decode rows over a
long cache and a first token over an empty one, and a sequence with no rows this step.
Its pages are shuffled and smaller than the sequences, so keys cross pages in the order
the lookup table gives, and the cache holds several layers, so the op must read its own.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, Graph, TensorType

from gpt2_max import kernels

pytestmark = pytest.mark.tier("model")

LAYERS, LAYER, PAGE = 3, 1, 16
SEQUENCES = {
    "prompt": (0, 37),
    "chunk behind a prefix": (45, 20),
    "decode": (80, 1),
    "first token": (0, 1),
    "idle": (30, 0),
    "few rows": (5, 7),
}
"""(cached tokens, query rows this step) per sequence of the batch."""


def cache_types(kv_heads: int, head_dim: int) -> list:
    """The op's inputs after its activations: row offsets, the paged cache (a buffer the
    op may write), its page stride, cache lengths, lookup table and layer."""
    cpu = DeviceRef.CPU()
    return [
        TensorType(DType.uint32, ["batch_plus_1"], cpu),
        BufferType(DType.float32, ["pages", 2, LAYERS, PAGE, kv_heads, head_dim], cpu),
        TensorType(DType.int64, [1], cpu),
        TensorType(DType.uint32, ["batch"], cpu),
        TensorType(DType.uint32, ["batch", "max_pages"], cpu),
        TensorType(DType.uint32, [], cpu),
    ]


def paged_cache(sequences, kv_heads: int, head_dim: int, rng):
    """A random cache for `sequences` ((cached, rows) each): its blocks, the cache
    lengths, row offsets and lookup table. Every sequence's pages are shuffled over a
    pool with spare pages; unused table entries point at a page no sequence owns."""
    cached, rows = (np.array(x, dtype=np.uint32) for x in zip(*sequences, strict=True))
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.uint32)
    pages_per_seq = [-(-int(c + r) // PAGE) for c, r in zip(cached, rows, strict=True)]
    pool = rng.permutation(sum(pages_per_seq) + 3)
    lut = np.full((len(rows), max(pages_per_seq) + 1), pool[-1], dtype=np.uint32)
    taken = 0
    for b, n in enumerate(pages_per_seq):
        lut[b, :n] = pool[taken : taken + n]
        taken += n
    blocks = rng.standard_normal(
        (len(pool), 2, LAYERS, PAGE, kv_heads, head_dim), dtype=np.float32
    )
    return blocks, cached, offsets, lut


def cache_inputs(offsets, blocks, cached, lut) -> list:
    """`cache_types`' values (`blocks` a buffer the op writes)."""
    return [
        Buffer.from_numpy(offsets), blocks, Buffer.from_numpy(np.array([-1], dtype=np.int64)),
        Buffer.from_numpy(cached), Buffer.from_numpy(lut),
        Buffer.from_numpy(np.array(LAYER, dtype=np.uint32)),
    ]


@functools.cache
def attention_op(heads: int, kv_heads: int, head_dim: int, scale: float):
    """The op for one head shape, compiled once over symbolic batch and cache sizes."""
    cpu = DeviceRef.CPU()
    types = [
        TensorType(DType.float32, ["tokens", heads, head_dim], cpu),
        *cache_types(kv_heads, head_dim),
    ]
    with Graph(f"attention_{heads}_{kv_heads}_{head_dim}", input_types=types) as graph:
        q, offsets, blocks, stride, lengths, lut, layer = graph.inputs
        cache = SimpleNamespace(
            kv_blocks=blocks.buffer, page_stride=stride.tensor,
            cache_lengths=lengths.tensor, lookup_table=lut.tensor,
        )
        graph.output(kernels.paged_attention(q.tensor, offsets.tensor, cache, layer.tensor, scale))
    return InferenceSession(devices=[CPU()]).load(graph)


def reference(q, offsets, blocks, lengths, lut, scale):
    """Causal attention in float64, reading keys and values through the lookup table."""
    out = np.zeros_like(q, dtype=np.float64)
    heads, kv_heads = q.shape[1], blocks.shape[4]
    for b in range(len(lengths)):
        rows = range(offsets[b], offsets[b + 1])
        n = lengths[b] + len(rows)
        pos = np.arange(n)
        k = blocks[lut[b, pos // PAGE], 0, LAYER, pos % PAGE].astype(np.float64)
        v = blocks[lut[b, pos // PAGE], 1, LAYER, pos % PAGE].astype(np.float64)
        for i, t in enumerate(rows):
            seen = lengths[b] + i + 1
            for h in range(heads):
                kh = h // (heads // kv_heads)
                s = scale * (k[:seen, kh] @ q[t, h].astype(np.float64))
                p = np.exp(s - s.max())
                out[t, h] = (p / p.sum()) @ v[:seen, kh]
    return out


def run(sequences, heads, kv_heads, head_dim, seed):
    rng = np.random.default_rng(seed)
    scale = 1 / np.sqrt(head_dim)
    blocks, cached, offsets, lut = paged_cache(sequences, kv_heads, head_dim, rng)
    # Large enough scores that the softmax is far from uniform.
    q = 2 * rng.standard_normal((int(offsets[-1]), heads, head_dim), dtype=np.float32)
    op = attention_op(heads, kv_heads, head_dim, float(scale))
    got = op.execute(
        Buffer.from_numpy(q), *cache_inputs(offsets, Buffer.from_numpy(blocks), cached, lut)
    )[0].to_numpy()
    expected = reference(q, offsets, blocks, cached, lut, scale)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 16, 12, 5])
def test_ragged_batch(head_dim):
    """Every row kind at GPT-2's head size, the tiny test model's, and sizes that fill
    no full vector (narrower lanes, scalar lanes)."""
    run(list(SEQUENCES.values()), 4, 4, head_dim, head_dim)


def test_grouped_heads():
    """Query heads sharing a cache head read that head's keys and values."""
    run(list(SEQUENCES.values()), 6, 2, 16, 1)


@pytest.mark.parametrize("sequences", [
    [(0, 300)], [(200, 1)] * 9, [(0, 130), (40, 3), (500, 60)], [(500, 1)], [(300, 5)],
])
def test_threaded(sequences):
    """Steps with enough work to spread over threads: a long prompt, a batch of decode
    rows over long caches, a mixed batch, and one sequence of one or a few rows, whose
    keys the threads share and whose results the last one merges."""
    run(sequences, 12, 12, 64, len(sequences))
