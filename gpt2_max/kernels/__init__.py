"""Mojo kernels shipped with gpt2_max, called as MAX custom ops where a graph is built.

`mojo/` is a Mojo source package, compiled once per source and MAX version into
MAX's cache (`package.py`); importing the architecture compiles and loads nothing
(the API process imports it and never builds a graph).

Each call stages its op with `F.custom`, as MAX's own ModuleV3 architectures call
theirs, rather than through a `custom.declare`d op: a declaration resolves its
kernel against a kernel library of its own, and every new library loads MAX's
whole kernel catalogue again, once per declared op and process. `F.custom`
verifies the op against the graph's library, which MAX loads once per process
for every graph linking the same packages. The output type is written here
(`[rows of x, rows of w]`, float32), so the shapes are checked here too.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from max.dtype import DType
from max.experimental import functional as F
from max.experimental.tensor import Tensor
from max.graph import DeviceRef, TensorType

from ..encodings import KERNEL_TYPES, block_geometry
from .package import compiled_package

MOJO_PACKAGE = Path(__file__).parent / "mojo"

SKINNY_MAX_ROWS = 16
"""Steps of up to this many rows (tokens of the whole batch) multiply float32 weights
through the skinny kernel, larger ones through MAX's tiled matmul: the skinny kernel
streams each weight once and is the faster of the two at decode sizes, the tiled one
reuses each packed weight tile across rows and is the faster at prefill sizes. The
linear ops read it as their `max_rows` parameter and switch as they run."""

def skinny_linear(x: Any, w: Any, b: Any, *, lined: bool = False) -> Tensor:
    """`x @ w.T + b`, streaming `w` once for up to `SKINNY_MAX_ROWS` rows of `x` (see
    `mojo/skinny.mojo`), through MAX's tiled matmul for more (see `mojo/ops.mojo`).

    `w` may be float32 or float16: the skinny kernel widens float16 as it loads it,
    and takes float16 weights at every row count, row-major or `lined` (as `lines`
    lays them out).
    """
    _same_features(x, w)
    return _call("gpt2_skinny_linear", x, w, b, max_rows=SKINNY_MAX_ROWS, lines=lined)


def skinny_matmul(x: Any, w: Any) -> Tensor:
    """`x @ w.T` (the tied LM head), the kernel chosen as by `skinny_linear`."""
    _same_features(x, w)
    return _call("gpt2_skinny_matmul", x, w, max_rows=SKINNY_MAX_ROWS)


LINE_BYTES = 64
"""Bytes of a cache line, the unit of a layout in lines (`lines`)."""
BLOCK_ROWS = 4
"""Weight rows the skinny kernel multiplies together (`mojo/skinny.mojo`'s `R`)."""


def in_lines(dtype: DType, row_lengths: Iterable[int]) -> bool:
    """Whether a fused block's float weights of `dtype`, rows of `row_lengths` values,
    are held in `lines`: float16 (float32 ones are MAX's tiled matmul's at prefill,
    which reads them row-major) in rows of whole lines."""
    per_line = LINE_BYTES // dtype.size_in_bytes
    return dtype == DType.float16 and all(k % per_line == 0 for k in row_lengths)


def lines(w: np.ndarray) -> np.ndarray:
    """A float weight (`[rows, K]`) in lines, as the skinny kernel reads it where asked
    (`mojo/skinny.mojo`): each block of `BLOCK_ROWS` rows stored a cache line of each
    row in turn, so the block streams as one run of memory rather than `BLOCK_ROWS`; the
    rows past the last whole block stay as they are. Same shape and values."""
    rows, K = w.shape
    per_line = LINE_BYTES // w.dtype.itemsize
    if K % per_line:
        raise ValueError(f"rows of {K} values are not whole lines of {per_line}")
    whole = rows // BLOCK_ROWS * BLOCK_ROWS
    out = w.copy()
    out[:whole] = (
        w[:whole].reshape(-1, BLOCK_ROWS, K // per_line, per_line)
        .transpose(0, 2, 1, 3).reshape(whole, K)
    )
    return out


DOTS = {"auto": 0, "float32": 1, "int8": 2, "int8x2": 3}
"""The packed kernel's arithmetic, at every row count (`mojo/kquant.mojo`'s `dot_path`):
"auto" is the fastest the CPU has for the format; a named one the CPU or format lacks
falls back to float32. Naming one is for tests and benchmarks, which compare them."""


GROUP = 16
"""Weight rows the packed kernel reads together, one a vector lane (`interleave`)."""

FIELDS = {
    "q4_0": ((0, 2, 2), (2, 18, 4)),
    "q5_0": ((0, 2, 2), (2, 6, 4), (6, 22, 4)),
    "q5_1": ((0, 2, 2), (2, 4, 2), (4, 8, 4), (8, 24, 4)),
    "q8_0": ((0, 2, 2), (2, 34, 4)),
    "q4_k": ((0, 4, 2), (4, 16, 1), (16, 144, 4)),
    "q5_k": ((0, 4, 2), (4, 16, 1), (16, 48, 4), (48, 176, 4)),
    "q6_k": ((0, 2, 2), (2, 18, 1), (18, 210, 4)),
}
"""Per grouped block type, its block's fields as `interleave` lays them out: (first byte,
end, unit), each field's units in order, each unit the `GROUP` rows' in turn (float16
scales in units of 2 bytes, 6- and 8-bit scales of 1, quants and high bits of 4: one
row's 4 bytes a 32-bit lane of a dot product). Q6_K's fields are those of
`_q6_k_lanes`' block, Q5_0's and Q5_1's high bits those of `_q5_lanes`."""
INTERLEAVED = frozenset(FIELDS)
"""The block types whose layout `interleave` changes."""


def interleave(encoding: str, blocks: np.ndarray) -> np.ndarray:
    """GGUF blocks (`[rows, row_bytes]`) in the layout the packed kernel reads: the
    file's, except for the `INTERLEAVED` types, whose rows go in groups of `GROUP`
    (`mojo/kquant.mojo`, "sixteen rows at a time"): block b of a group holds the rows'
    block b field after field (`FIELDS`), unit after unit, row after row. The rows past
    the last whole group stay as they are. Same shape and bytes, so it is done once at
    load."""
    if encoding not in INTERLEAVED:
        return blocks
    rows, row_bytes = blocks.shape
    size = block_geometry(encoding)[1]
    groups, nb = rows // GROUP, row_bytes // size
    grouped = blocks[: groups * GROUP].reshape(groups, GROUP, nb, size)
    if encoding == "q6_k":
        grouped = _q6_k_lanes(grouped)
    elif encoding in ("q5_0", "q5_1"):
        grouped = _q5_lanes(grouped, FIELDS[encoding][-2][0])
    parts = [
        grouped[..., a:b].reshape(groups, GROUP, nb, (b - a) // unit, unit)
        .transpose(0, 2, 3, 1, 4).reshape(groups, nb, (b - a) * GROUP)
        for a, b, unit in FIELDS[encoding]
    ]
    out = blocks.copy()
    out[: groups * GROUP] = np.concatenate(parts, axis=-1).reshape(groups * GROUP, row_bytes)
    return out


def _q6_k_lanes(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks (`[..., 210]`: ggml's 128 bytes of low nibbles, 64 of high bit pairs,
    16 int8 scales, float16 d) as d, the scales, then for u = 0..15 three units of 4
    bytes, A, B and C. Weight 4c + i (c = 0..63, i = 0..3) is in byte i: its six bits
    the low six of A (c = u), B (u + 16) or C (u + 32), or (u + 48) the top two bits of
    A, B and C in turn. So three of a column's four 64-byte vectors for 16 rows are one
    AND of a load each, and the fourth takes three (`_kx16_col`)."""
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    h, s, i = np.arange(2)[:, None, None], np.arange(4)[None, :, None], np.arange(32)
    low = (ql[..., 64 * h + 32 * (s % 2) + i] >> (4 * (s // 2))) & 0xF
    high = (qh[..., 32 * h + i] >> (2 * s)) & 3
    q = (low | high << 4).reshape(*blocks.shape[:-1], 4, 16, 4)  # [..., c // 16, u, i]
    last = q[..., 3, :, :]
    lanes = np.stack([q[..., a, :, :] | (last >> 2 * a & 3) << 6 for a in range(3)], axis=-2)
    return np.concatenate([
        blocks[..., 208:210], blocks[..., 192:208],
        lanes.reshape(*blocks.shape[:-1], 192).astype(np.uint8),
    ], axis=-1)


def _q5_lanes(blocks: np.ndarray, at: int) -> np.ndarray:
    """Q5_0 or Q5_1 blocks with the 4 bytes of high bits at `at` (bit l of the
    little-endian word: weight l's bit 4) regrouped so that bit c of byte i is weight 4c
    + i's: the bits of a column of 4 weights (`mojo/kquant.mojo`'s `_b32x16_col`) sit
    at one bit position of the 4 bytes, one shift from bit 4."""
    bits = np.unpackbits(blocks[..., at : at + 4], axis=-1, bitorder="little")
    columns = bits.reshape(*bits.shape[:-1], 8, 4).swapaxes(-1, -2)  # [..., i, c]
    out = blocks.copy()
    out[..., at : at + 4] = np.packbits(columns, axis=-1, bitorder="little")[..., 0]
    return out


def packed_linear(encoding: str, x: Any, w: Any, b: Any, *, dot: str = "auto") -> Tensor:
    """`x @ dequant(w).T + b`, `w` GGUF blocks of `encoding` as `interleave` lays them out."""
    return _call("gpt2_packed_linear", x, w, b, fmt=KERNEL_TYPES[encoding], dot=DOTS[dot])


def packed_matmul(encoding: str, x: Any, w: Any, *, dot: str = "auto") -> Tensor:
    """`x @ dequant(w).T`, `w` as for `packed_linear` (a tied head over a packed table)."""
    return _call("gpt2_packed_matmul", x, w, fmt=KERNEL_TYPES[encoding], dot=DOTS[dot])


def paged_attention(
    q: Any, input_row_offsets: Any, kv_collection: Any, layer_idx: Any, scale: float
) -> Tensor:
    """Causal attention of `q` (`[tokens, heads, head_dim]`, a ragged batch) over layer
    `layer_idx` of the paged KV cache, which already holds the step's keys and values
    (see `mojo/attention.mojo`); `[tokens, heads, head_dim]` like `q`."""
    cpu = DeviceRef.CPU()
    out = TensorType(DType.float32, list(q.shape), DeviceRef.from_device(q.device))
    values = [
        q, input_row_offsets, kv_collection.kv_blocks, kv_collection.page_stride,
        kv_collection.cache_lengths, kv_collection.lookup_table, layer_idx,
        F.constant(scale, DType.float32, device=cpu),
    ]
    return F.inplace_custom(
        "gpt2_paged_attention", q.device, values, [out],
        parameters={"head_dim": int(q.shape[2])},
        custom_extensions=[compiled_package(MOJO_PACKAGE)],
    )[0]


def decoder_block(
    x: Any, ln_1: Any, c_attn: Any, c_proj: Any, ln_2: Any, c_fc: Any, mlp_proj: Any,
    input_row_offsets: Any, kv_collection: Any, layer_idx: Any, scale: float, head_dim: int,
    *, encodings: tuple[str | None, ...] = (None,) * 4, dot: str = "auto", lined: bool = False,
) -> Tensor:
    """One GPT-2 block, `h = x + attn(ln_1(x))` then `h + mlp(ln_2(h))` with a tanh GELU,
    as one op (see `mojo/block.mojo`); the step's keys and values go into layer
    `layer_idx` of the paged cache. `ln_1` is `(weight, bias, eps)`, `ln_2`
    `(weight, bias)` normalized with the same eps (GPT-2 has one), the projections
    `(weight, bias)`: `[out, in]` float weights of one dtype (float32 or float16), or,
    where `encodings` names the four projections' GGUF block types, their blocks as
    `interleave` lays them out, multiplied as `packed_linear` does with `dot`. Float
    weights are row-major, or `lined` as `lines` lays them out."""
    if len({e is None for e in encodings}) != 1:
        raise ValueError(f"a block's projections are all float or all packed, not {encodings}")
    cpu = DeviceRef.CPU()
    out = TensorType(DType.float32, list(x.shape), DeviceRef.from_device(x.device))
    values = [
        x, ln_1[0], ln_1[1], *c_attn, *c_proj, ln_2[0], ln_2[1], *c_fc, *mlp_proj,
        input_row_offsets, kv_collection.kv_blocks, kv_collection.page_stride,
        kv_collection.cache_lengths, kv_collection.lookup_table, layer_idx,
        F.constant(scale, DType.float32, device=cpu),
        F.constant(ln_1[2], DType.float32, device=cpu),
    ]
    return F.inplace_custom(
        "gpt2_decoder_block", x.device, values, [out],
        parameters={
            "head_dim": head_dim, "max_rows": SKINNY_MAX_ROWS, "dot": DOTS[dot],
            "lines": lined,
            **{
                f"f_{name}": KERNEL_TYPES[e] if e else 0
                for name, e in zip(("qkv", "o", "fc", "p"), encodings, strict=True)
            },
        },
        custom_extensions=[compiled_package(MOJO_PACKAGE)],
    )[0]


def _same_features(x: Any, w: Any) -> None:
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features per row, w {w.shape[1]}")


def _call(name: str, x: Any, w: Any, *rest: Any, **parameters: int) -> Tensor:
    """Stages kernel `name` on `[x, w, *rest]`, giving float32 `[rows of x, rows of w]`."""
    out = TensorType(DType.float32, [x.shape[0], w.shape[0]], DeviceRef.from_device(x.device))
    return F.custom(
        name, x.device, [x, w, *rest], [out],
        parameters=parameters or None,
        custom_extensions=[compiled_package(MOJO_PACKAGE)],
    )[0]
