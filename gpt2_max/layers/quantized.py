"""A linear layer over GGUF-packed weights, through MAX's quantized CPU kernels
or, for block types MAX has none for (Q5_K, Q5_0, Q5_1, Q8_0), the package's
(`kernels/mojo/kquant.mojo`, the blocks as the file stores them).

ModuleV3's `Linear` holds float weights only. `QuantizedLinear` keeps a weight
as its GGUF blocks (`uint8`, `[rows, row_bytes]`, one row per output feature);
MAX's kernel quantizes the activations to 8 bits per block and runs integer dot
products against them on the CPU. `FastLayers.linear` builds one for each
weight the weights plan lists as packed, so `gpt2.py` builds the same tree for
every file type.

The kernel multiplies a repacked layout of the blocks (same shape and bytes per
row, interleaved for its dot products). `F.qmatmul` repacks inside the graph,
so every decode step would rewrite every packed weight before reading it;
`repack` does that once at load (`FastLayers.prepare`), and
the graph calls MAX's matmul kernel on the result.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.tensor import Tensor
from max.graph import DeviceRef, Graph, Shape, TensorType, ops
from max.graph.quantization import QuantizationEncoding
from max.graph.weights import WeightData

from .. import kernels
from ..encodings import PACKED_ENCODINGS, block_geometry
from ..names import PACKAGE
from ..shims.internals import quantized_matmul_op, quantized_repack_op
from ..weights.hugepages import hugepage_array
from ..weights.plan import block_type

PACKED_ROWS_MULTIPLE = 32
"""MAX's CPU `qmatmul` kernels take a multiple of 32 weight rows (output
features); a table with other counts (GPT-2's 50257 tokens) is padded with
all-zero blocks, which decode to zeros, and the extra outputs are cut off."""


def has_max_kernel(encoding: str) -> bool:
    """Whether MAX's CPU `qmatmul` multiplies block type `encoding`
    (`encodings.PACKED_ENCODINGS`); the rest go through the package's kernel.

    Q4_K and Q6_K stay with MAX although the package's kernel runs their decode steps
    about as fast (`benchmarks/bench_packed.py`): a weight's kernel serves every step
    size, and the package's prefill (each weight row decoded again per tile of input
    rows, so that every row count runs one arithmetic) is several times slower than
    `qmatmul`'s.
    """
    return encoding in PACKED_ENCODINGS


def padded_rows(rows: int) -> int:
    return -(-rows // PACKED_ROWS_MULTIPLE) * PACKED_ROWS_MULTIPLE


def packed_row_bytes(features: int, encoding: str) -> int:
    """Bytes of one packed row of `features` values."""
    values, size = block_geometry(encoding)
    if features % values:
        raise ValueError(
            f"{encoding} packs rows of a multiple of {values} values; this row has {features}."
        )
    return features // values * size


class QuantizedLinear(Module[[Tensor], Tensor]):
    """`x @ W.T + b` with `W` in GGUF blocks, through `qmatmul`."""

    weight: Tensor
    bias: Tensor | Literal[0]

    def __init__(
        self, in_dim: int, out_dim: int, encoding: str, *, bias: bool = True
    ) -> None:
        self.encoding = encoding
        self.out_dim = out_dim
        rows = padded_rows(out_dim) if has_max_kernel(encoding) else out_dim
        self.weight = Tensor.zeros(
            [rows, packed_row_bytes(in_dim, encoding)], dtype=DType.uint8
        )
        self.bias = Tensor.zeros([out_dim]) if bias else 0

    def forward(self, x: Tensor) -> Tensor:
        if not has_max_kernel(self.encoding):
            if isinstance(self.bias, int):
                return kernels.packed_matmul(self.encoding, x, self.weight)
            return kernels.packed_linear(self.encoding, x, self.weight, self.bias)
        y = _matmul(QuantizationEncoding[self.encoding.upper()], x, self.weight)
        if padded_rows(self.out_dim) != self.out_dim:
            y = y[:, : self.out_dim]
        return y + self.bias


def _matmul(encoding: QuantizationEncoding, x: Tensor, w: Tensor) -> Tensor:
    """MAX's kernel for `x @ W.T`, `W` repacked (`repack`); staged with `F.custom`
    for the reason `kernels` gives."""
    out = TensorType(DType.float32, [x.shape[0], w.shape[0]], DeviceRef.from_device(x.device))
    return F.custom(quantized_matmul_op(encoding), x.device, [x, w], [out])[0]


def _repack_graph(encoding: QuantizationEncoding) -> Graph:
    packed = TensorType(DType.uint8, ["rows", "row_bytes"], DeviceRef.CPU())
    name = f"{PACKAGE}_repack_{encoding.name}"
    with Graph(name, input_types=[packed]) as graph:
        op = quantized_repack_op(encoding)
        graph.output(ops.custom(op, DeviceRef.CPU(), [graph.inputs[0]], [packed])[0])
    return graph


def repack(state_dict: dict[str, WeightData]) -> dict[str, WeightData]:
    """`state_dict` with every packed weight in the layout MAX's matmul kernel reads,
    its rows padded to `padded_rows` (unchanged when nothing is packed).

    One small graph per encoding, compiled in a session of its own, repacks
    them all; each result is copied into memory the model keeps, in huge
    pages as the adapters' copies are (`weights/mapping.py`).
    """
    packed = {
        n: w for n, w in state_dict.items()
        if (kind := block_type(w)) is not None and has_max_kernel(kind)
    }
    if not packed:
        return state_dict
    session = InferenceSession(devices=[CPU()])
    repackers = {
        encoding: session.load(_repack_graph(encoding))
        for encoding in {w.quantization_encoding for w in packed.values()}
    }
    repacked = dict(state_dict)
    for name, weight in packed.items():
        encoding = weight.quantization_encoding
        blocks = np.asarray(weight.data)
        rows = padded_rows(blocks.shape[0])
        blocks = np.pad(blocks, ((0, rows - blocks.shape[0]), (0, 0)))
        result = repackers[encoding].execute(Buffer.from_numpy(blocks))[0].to_numpy()
        repacked[name] = WeightData(
            hugepage_array(result), name, weight.dtype, Shape(result.shape), encoding
        )
    return repacked
