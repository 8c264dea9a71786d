"""A linear layer over GGUF-packed weights, through MAX's quantized CPU kernel
(`qmatmul.py`) or the package's (`kernels/mojo/kquant.mojo`, the blocks as the
file stores them but Q4_0's and the K-quants', `kernels.interleave`), whichever `kernel_choice`
measured the faster on this CPU for the block type and the plan's work; MAX has none
for Q5_K, Q5_0, Q5_1 and Q8_0.

ModuleV3's `Linear` holds float weights only. `QuantizedLinear` keeps a weight
as its GGUF blocks (`uint8`, `[rows, row_bytes]`, one row per output feature).
`FastLayers.linear` builds one for each weight the weights plan lists as packed,
so `gpt2.py` builds the same tree for every file type; `repack` gives each weight
its kernel's layout at load (`FastLayers.prepare`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import numpy as np
from max.dtype import DType
from max.experimental.nn import Module
from max.experimental.tensor import Tensor
from max.graph.weights import WeightData

from .. import kernels
from ..encodings import BLOCK_FLAGS, block_geometry
from ..names import PACKAGE
from ..weights.hugepages import hugepage_array
from ..weights.plan import block_type, packed_weight
from . import qmatmul
from .kernel_choice import choice, uses_max_kernel

logger = logging.getLogger("max.pipelines")


def packed_row_bytes(features: int, encoding: str) -> int:
    """Bytes of one packed row of `features` values."""
    values, size = block_geometry(encoding)
    if features % values:
        raise ValueError(
            f"{encoding} packs rows of a multiple of {values} values; this row has {features}."
        )
    return features // values * size


class QuantizedLinear(Module[[Tensor], Tensor]):
    """`x @ W.T + b` with `W` in GGUF blocks."""

    weight: Tensor
    bias: Tensor | Literal[0]

    def __init__(
        self, in_dim: int, out_dim: int, encoding: str, *, bias: bool = True,
        work: str = "request",
    ) -> None:
        self.encoding = encoding
        self.out_dim = out_dim
        self.max_kernel = uses_max_kernel(encoding, work)
        rows = qmatmul.padded_rows(out_dim) if self.max_kernel else out_dim
        self.weight = Tensor.zeros(
            [rows, packed_row_bytes(in_dim, encoding)], dtype=DType.uint8
        )
        self.bias = Tensor.zeros([out_dim]) if bias else 0

    def forward(self, x: Tensor) -> Tensor:
        if not self.max_kernel:
            if isinstance(self.bias, int):
                return kernels.packed_matmul(self.encoding, x, self.weight)
            return kernels.packed_linear(self.encoding, x, self.weight, self.bias)
        y = qmatmul.matmul(self.encoding, x, self.weight)
        if qmatmul.padded_rows(self.out_dim) != self.out_dim:
            y = y[:, : self.out_dim]
        return y + self.bias


def repack(
    state_dict: dict[str, WeightData], work_of: Callable[[str], str] = lambda name: "request"
) -> dict[str, WeightData]:
    """`state_dict` with every packed weight in the layout its kernel reads (MAX's
    repacked, the package's `kernels.interleave`d; unchanged where both are the file's),
    each copied into memory the model keeps, in huge pages as the adapters' copies are
    (`weights/formats.py`). `work_of(name)` picks the kernels as `QuantizedLinear`'s
    `work` does (`WeightPlan.work_of`)."""
    bound = {}
    told = set()
    for name, weight in state_dict.items():
        if (kind := block_type(weight)) is not None:
            work = work_of(name)
            if work != "request" and kind in BLOCK_FLAGS and (kind, work) not in told:
                told.add((kind, work))
                logger.info(f"{PACKAGE}: {choice(kind).describe(kind, work)}")
            on_max = uses_max_kernel(kind, work)
            if on_max or kind in kernels.INTERLEAVED:
                bound[name] = (weight, kind, on_max)
    if not bound:
        return state_dict
    repacker = qmatmul.Repacker({kind for _, kind, on_max in bound.values() if on_max})
    repacked = dict(state_dict)
    for name, (weight, kind, on_max) in bound.items():
        blocks = np.asarray(weight.data)
        result = repacker(kind, blocks) if on_max else kernels.interleave(kind, blocks)
        repacked[name] = packed_weight(hugepage_array(result), name, kind)
    return repacked
