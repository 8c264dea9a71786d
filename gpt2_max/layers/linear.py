"""Linear layers that stream their weights once per decode step.

A decode step multiplies a handful of rows by every weight matrix, so its cost is
reading the weights from memory; MAX's CPU matmul tiles and repacks the weights for
many rows and streams them slower at one row or a few. `project` stages one op of this
package's (`kernels.skinny_linear` / `skinny_matmul`) per projection, which picks its
kernel from the row count as it runs: the skinny Mojo kernel
(`kernels/mojo/skinny.mojo`) for decode-sized steps, MAX's own CPU matmul for prefill
(`kernels.SKINNY_MAX_ROWS` is the switch). One op rather than both paths behind a
graph-level `F.cond` per projection: a decode step would otherwise pay a conditional's
fixed cost on each of them. Both kernels accumulate in float32, so the choice changes
only the summation order.

Weights may be float16 (F16 GGUFs): the kernel reads them as they are, halving the
bytes a decode step streams. It also serves their prefills, a pass over the weights per
64 rows: MAX's matmul multiplies float32 by float32 only, and widening every weight for
it would hold float32 copies of them all, the memory float16 saves.
"""

from __future__ import annotations

from max.dtype import DType
from max.experimental.nn import Linear
from max.experimental.tensor import Tensor

from .. import kernels


def project(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T (+ bias)` for `weight` in `[out, in]` layout, `x` float32 on the
    CPU (where the fast layers run), through this package's op."""
    if bias is None:
        return kernels.skinny_matmul(x, weight)
    return kernels.skinny_linear(x, weight, bias)


class SkinnyLinear(Linear):
    """MAX's `Linear` (same parameters, same checkpoint names) computed by `project`,
    with its weight held in `dtype` (float32, or float16 as an F16 GGUF stores it)."""

    def __init__(
        self, in_dim: int, out_dim: int, *, bias: bool = True, dtype: DType = DType.float32
    ) -> None:
        super().__init__(in_dim, out_dim, bias=bias)
        if dtype != self.weight.dtype:
            self.weight = Tensor.zeros([out_dim, in_dim], dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return project(x, self.weight, None if isinstance(self.bias, int) else self.bias)
