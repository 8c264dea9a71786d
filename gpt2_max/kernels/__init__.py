"""Mojo kernels shipped with gpt2_max, declared as MAX custom ops.

`mojo/` is a Mojo source package; MAX compiles it once per process (`mojo precompile`,
about a second) when the ops are declared, and the graph links the result.
"""

from __future__ import annotations

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
