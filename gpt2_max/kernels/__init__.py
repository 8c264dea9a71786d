"""Mojo kernels shipped with gpt2_max, declared as MAX custom ops where a graph is built.

`mojo/` is a Mojo source package. Declaring an op with it as a source folder makes
MAX run `mojo precompile` in that process, once per op. Importing the architecture
must not pay that (the API process imports it and never builds a graph), so the
ops are declared on first use, and against the package compiled once per source
and MAX version (`package.py`), which later starts find in MAX's cache folder.
"""

from __future__ import annotations

import functools
from pathlib import Path

from max.dtype import DType
from max.experimental import custom

from .package import compiled_package

MOJO_PACKAGE = Path(__file__).parent / "mojo"


def _signature() -> tuple:
    m, k, n = custom.Symbols("m", "k", "n")
    x = custom.TemplateType(DType.float32, [m, k])
    # Weights may be float32 or float16: the kernel widens float16 as it loads it.
    w = custom.TemplateType(custom.DTypeVar("w"), [n, k])
    y = custom.TemplateType(DType.float32, [m, n])
    return x, w, y, custom.TemplateType(DType.float32, [n])


@functools.cache
def skinny_linear() -> custom.CustomOp:
    """`x @ w.T + b` for a few rows of `x`, streaming `w` once (see `mojo/skinny.mojo`)."""
    x, w, y, b = _signature()
    return custom.declare(
        "gpt2_skinny_linear",
        inputs={"x": x, "w": w, "b": b},
        outputs=[y],
        custom_extensions=[compiled_package(MOJO_PACKAGE)],
    )


@functools.cache
def skinny_matmul() -> custom.CustomOp:
    """`x @ w.T` for a few rows of `x` (the tied LM head)."""
    x, w, y, _ = _signature()
    return custom.declare(
        "gpt2_skinny_matmul",
        inputs={"x": x, "w": w},
        outputs=[y],
        custom_extensions=[compiled_package(MOJO_PACKAGE)],
    )


PACKED_TYPES = {"q4_0": 2, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}
"""GGUF block types the packed kernel decodes (`mojo/kquant.mojo`), by encoding name,
with the GGML type id the kernel is specialised on."""


def packed_linear(encoding: str) -> custom.CustomOp:
    """`x @ dequant(w).T + b`, `w` GGUF blocks of `encoding` as the file stores them."""
    return _packed_op("gpt2_packed_linear", encoding)


def packed_matmul(encoding: str) -> custom.CustomOp:
    """`x @ dequant(w).T`, `w` GGUF blocks of `encoding` (a tied head over a packed table)."""
    return _packed_op("gpt2_packed_matmul", encoding)


@functools.cache
def _packed_op(name: str, encoding: str) -> custom.CustomOp:
    m, k, n = custom.Symbols("m", "k", "n")
    (row_bytes,) = custom.Symbols("row_bytes")
    inputs = {
        "x": custom.TemplateType(DType.float32, [m, k]),
        "w": custom.TemplateType(DType.uint8, [n, row_bytes]),
    }
    if name == "gpt2_packed_linear":
        inputs["b"] = custom.TemplateType(DType.float32, [n])
    return custom.declare(
        name,
        inputs=inputs,
        outputs=[custom.TemplateType(DType.float32, [m, n])],
        parameters={"fmt": PACKED_TYPES[encoding]},
        custom_extensions=[compiled_package(MOJO_PACKAGE)],
    )
