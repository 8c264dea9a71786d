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
