"""Mojo kernels shipped with gpt2_max, declared as MAX custom ops.

`mojo/` is a Mojo source package; MAX compiles it once per process (`mojo precompile`,
about a second) when the ops are declared, and the graph links the result.
"""

from __future__ import annotations

import functools
from pathlib import Path

from max.dtype import DType
from max.experimental import custom

MOJO_PACKAGE = Path(__file__).parent / "mojo"

_m, _k, _n = custom.Symbols("m", "k", "n")
_x = custom.TemplateType(DType.float32, [_m, _k])
_w = custom.TemplateType(custom.DTypeVar("w"), [_n, _k])
"""Weights may be float32 or float16: the kernel widens float16 as it loads it."""
_y = custom.TemplateType(DType.float32, [_m, _n])

skinny_linear = custom.declare(
    "gpt2_skinny_linear",
    inputs={"x": _x, "w": _w, "b": custom.TemplateType(DType.float32, [_n])},
    outputs=[_y],
    custom_extensions=[MOJO_PACKAGE],
)
"""`x @ w.T + b` for a few rows of `x`, streaming `w` once (see `mojo/skinny.mojo`)."""

skinny_matmul = custom.declare(
    "gpt2_skinny_matmul",
    inputs={"x": _x, "w": _w},
    outputs=[_y],
    custom_extensions=[MOJO_PACKAGE],
)
"""`x @ w.T` for a few rows of `x` (the tied LM head)."""

PACKED_TYPES = {"q4_0": 2, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
"""GGUF block types the packed kernel decodes (`mojo/kquant.mojo`), by encoding name,
with the GGML type id the kernel is specialised on."""

_packed_w = custom.TemplateType(DType.uint8, [_n, custom.Symbols("row_bytes")[0]])


def packed_linear(encoding: str) -> custom.CustomOp:
    """`x @ dequant(w).T + b`, `w` GGUF blocks of `encoding` as the file stores them."""
    return _packed_op("gpt2_packed_linear", encoding)


def packed_matmul(encoding: str) -> custom.CustomOp:
    """`x @ dequant(w).T`, `w` GGUF blocks of `encoding` (a tied head over a packed table)."""
    return _packed_op("gpt2_packed_matmul", encoding)


@functools.cache
def _packed_op(name: str, encoding: str) -> custom.CustomOp:
    inputs = {"x": _x, "w": _packed_w}
    if name == "gpt2_packed_linear":
        inputs["b"] = custom.TemplateType(DType.float32, [_n])
    return custom.declare(
        name,
        inputs=inputs,
        outputs=[_y],
        parameters={"fmt": PACKED_TYPES[encoding]},
        custom_extensions=[MOJO_PACKAGE],
    )
