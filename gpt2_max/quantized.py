"""A linear layer over GGUF-packed weights, through MAX's `qmatmul`.

ModuleV3's `Linear` holds float weights only. `QuantizedLinear` keeps a weight
as its GGUF blocks (`uint8`, `[rows, row_bytes]`, one row per output feature);
`F.qmatmul` quantizes the activations to 8 bits per block and runs integer dot
products against them on the CPU. `linear` picks the class from the encoding
the loaded weight carries (`GPT2ArchConfig.packed_weights`), so `gpt2.py` builds
the same tree for every file type.
"""

from __future__ import annotations

from typing import Literal

from max.dtype import DType
from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.tensor import Tensor
from max.graph.quantization import QuantizationEncoding

from .linear import SkinnyLinear
from .model_config import GPT2ArchConfig

PACKED_ROWS_MULTIPLE = 32
"""MAX's CPU `qmatmul` kernels take a multiple of 32 weight rows (output
features); a table with other counts (GPT-2's 50257 tokens) is padded with
all-zero blocks, which decode to zeros, and the extra outputs are cut off."""


def padded_rows(rows: int) -> int:
    return -(-rows // PACKED_ROWS_MULTIPLE) * PACKED_ROWS_MULTIPLE


def packed_row_bytes(features: int, encoding: QuantizationEncoding) -> int:
    """Bytes of one packed row of `features` values."""
    if features % encoding.elements_per_block:
        raise ValueError(
            f"{encoding.name} packs rows of a multiple of {encoding.elements_per_block} "
            f"values; this row has {features}."
        )
    return features // encoding.elements_per_block * encoding.block_size


class QuantizedLinear(Module[[Tensor], Tensor]):
    """`x @ W.T + b` with `W` in GGUF blocks, through `qmatmul`."""

    weight: Tensor
    bias: Tensor | Literal[0]

    def __init__(
        self, in_dim: int, out_dim: int, encoding: QuantizationEncoding, *, bias: bool = True
    ) -> None:
        self.encoding = encoding
        self.out_dim = out_dim
        self.weight = Tensor.zeros(
            [padded_rows(out_dim), packed_row_bytes(in_dim, encoding)], dtype=DType.uint8
        )
        self.bias = Tensor.zeros([out_dim]) if bias else 0

    def forward(self, x: Tensor) -> Tensor:
        return packed_matmul(self.encoding, x, self.weight, self.out_dim) + self.bias


def packed_matmul(encoding: QuantizationEncoding, x: Tensor, weight: Tensor, rows: int) -> Tensor:
    """`x @ weight[:rows].T` for a row-padded packed weight."""
    y = F.qmatmul(encoding, None, x, weight)
    return y if padded_rows(rows) == rows else y[:, :rows]


def linear(
    config: GPT2ArchConfig, name: str, in_dim: int, out_dim: int, *, bias: bool = True
) -> SkinnyLinear | QuantizedLinear:
    """The linear layer for parameter prefix `name`, packed if its weight is, else
    holding its weight in the dtype it was loaded in."""
    encoding = config.packed_weights.get(f"{name}.weight")
    if encoding is None:
        dtype = config.weight_dtype(f"{name}.weight")
        return SkinnyLinear(in_dim, out_dim, bias=bias, dtype=dtype)
    return QuantizedLinear(in_dim, out_dim, encoding, bias=bias)
