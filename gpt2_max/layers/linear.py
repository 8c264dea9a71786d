"""Linear layers that stream their weights once per decode step.

A decode step multiplies a handful of rows by every weight matrix, so its cost is reading
the weights from memory; MAX's CPU matmul tiles and repacks the weights for many rows and
streams them slower at one row or a few. `project` compiles both into the graph and picks
one at run time from the row count: this package's skinny Mojo kernel
(`kernels/mojo/skinny.mojo`) for decode-sized steps, MAX's matmul for prefill. Both
accumulate in float32, so the choice changes only the summation order.

Weights may be float16 (F16 GGUFs): the kernel reads them as they are, halving the
bytes a decode step streams. It also serves their prefills, a pass over the weights per
64 rows: MAX's matmul multiplies float32 by float32 only, and widening every weight for
it would hold float32 copies of them all, the memory float16 saves.
"""

from __future__ import annotations

from max.dtype import DType
from max.experimental import functional as F
from max.experimental.nn import Linear
from max.experimental.tensor import Tensor
from max.graph import DeviceRef, TensorType, TensorValue

from .. import kernels

SKINNY_MAX_ROWS = 16
"""Steps of up to this many rows (tokens of the whole batch) use the skinny kernel."""


def project(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ weight.T (+ bias)` for `weight` in `[out, in]` layout."""

    def gemm() -> Tensor:
        y = x @ (weight if weight.dtype == x.dtype else weight.cast(x.dtype)).T
        return y if bias is None else y + bias

    if x.dtype != DType.float32 or not x.device.is_host:
        return gemm()
    if weight.dtype != x.dtype:
        # MAX's matmul would need the weight widened to a float32 copy first.
        return skinny_of(x, weight, bias)

    # Stage the parameters in the enclosing graph first: one first used inside a branch
    # would be defined there, out of the other branch's reach.
    weight = Tensor.from_graph_value(TensorValue(weight))
    if bias is not None:
        bias = Tensor.from_graph_value(TensorValue(bias))

    def skinny() -> Tensor:
        return skinny_of(x, weight, bias)

    rows = F.shape_to_tensor([x.shape[0]]).reshape([])
    out = TensorType(x.dtype, [x.shape[0], weight.shape[0]], DeviceRef.from_device(x.device))
    return F.cond(rows <= SKINNY_MAX_ROWS, [out], skinny, gemm)[0]


def skinny_of(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`x @ weight.T (+ bias)` through the skinny kernel."""
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
