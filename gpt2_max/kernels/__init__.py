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

def skinny_linear(x: Any, w: Any, b: Any) -> Tensor:
    """`x @ w.T + b`, streaming `w` once for up to `SKINNY_MAX_ROWS` rows of `x` (see
    `mojo/skinny.mojo`), through MAX's tiled matmul for more (see `mojo/ops.mojo`).

    `w` may be float32 or float16: the skinny kernel widens float16 as it loads it,
    and takes float16 weights at every row count.
    """
    _same_features(x, w)
    return _call("gpt2_skinny_linear", x, w, b, max_rows=SKINNY_MAX_ROWS)


def skinny_matmul(x: Any, w: Any) -> Tensor:
    """`x @ w.T` (the tied LM head), the kernel chosen as by `skinny_linear`."""
    _same_features(x, w)
    return _call("gpt2_skinny_matmul", x, w, max_rows=SKINNY_MAX_ROWS)


DOTS = {"auto": 0, "float32": 1, "bfloat16": 2, "int8": 3, "int8x2": 4}
"""The packed kernel's arithmetic, at every row count (`mojo/kquant.mojo`'s `dot_path`):
"auto" is the fastest the CPU has for the format; a named one the CPU or format lacks
falls back to float32. Naming one is for tests and benchmarks, which compare them."""


GROUP = 16
"""Q4_0 weight rows the packed kernel reads together, one a vector lane (`interleave`)."""
INTERLEAVED = frozenset({"q4_0"})
"""The block types whose layout `interleave` changes."""


def interleave(encoding: str, blocks: np.ndarray) -> np.ndarray:
    """GGUF blocks (`[rows, row_bytes]`) in the layout the packed kernel reads: the
    file's, except for Q4_0, whose rows go in groups of `GROUP` (`mojo/kquant.mojo`,
    `_tile_q4_0x16`). Block b of a group is its rows' float16 scales, then for j = 0..3
    each row's quant bytes 4j .. 4j+3, row after row; the rows past the last whole group
    stay as they are. Same shape and bytes, so it is done once at load."""
    if encoding not in INTERLEAVED:
        return blocks
    rows, row_bytes = blocks.shape
    size = block_geometry(encoding)[1]
    groups, nb = rows // GROUP, row_bytes // size
    grouped = blocks[: groups * GROUP].reshape(groups, GROUP, nb, size)
    scales = grouped[..., :2].transpose(0, 2, 1, 3).reshape(groups, nb, 2 * GROUP)
    quants = grouped[..., 2:].reshape(groups, GROUP, nb, 4, 4).transpose(0, 2, 3, 1, 4)
    out = blocks.copy()
    out[: groups * GROUP] = np.concatenate(
        [scales, quants.reshape(groups, nb, (size - 2) * GROUP)], axis=-1
    ).reshape(groups * GROUP, row_bytes)
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
) -> Tensor:
    """One GPT-2 block, `h = x + attn(ln_1(x))` then `h + mlp(ln_2(h))` with a tanh GELU,
    as one op (see `mojo/block.mojo`); the step's keys and values go into layer
    `layer_idx` of the paged cache. `ln_1` is `(weight, bias, eps)`, `ln_2`
    `(weight, bias)` normalized with the same eps (GPT-2 has one), the projections
    `(weight, bias)` with `[out, in]` weights of one dtype (float32 or float16)."""
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
        parameters={"head_dim": head_dim, "max_rows": SKINNY_MAX_ROWS},
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
