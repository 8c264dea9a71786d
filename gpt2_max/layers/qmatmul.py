"""MAX's quantized CPU matmul (`qmatmul`, its `vroom` kernels) over GGUF blocks.

MAX's kernel multiplies a repacked layout of the blocks (same shape and bytes per
row, interleaved for its dot products) and quantizes the activations to 8 bits
per block. `F.qmatmul` repacks inside the graph, so every decode step would
rewrite every packed weight before reading it; `Repacker` does that once at load
and `matmul` calls the kernel on the result.
"""

from __future__ import annotations

import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.experimental import functional as F
from max.experimental.tensor import Tensor
from max.graph import DeviceRef, Graph, TensorType, ops
from max.graph.quantization import QuantizationEncoding

from ..names import PACKAGE
from ..shims.internals import quantized_matmul_op, quantized_repack_op

ROWS_MULTIPLE = 32
"""MAX's CPU `qmatmul` kernels take a multiple of 32 weight rows (output features); a
table with other counts (GPT-2's 50257 tokens) is padded with all-zero blocks, which
decode to zeros, and the extra outputs are cut off."""


def padded_rows(rows: int) -> int:
    return -(-rows // ROWS_MULTIPLE) * ROWS_MULTIPLE


def matmul(encoding: str, x: Tensor, w: Tensor) -> Tensor:
    """`x @ W.T` for `W` repacked (`Repacker`), float32 `[rows of x, rows of w]`; staged
    with `F.custom` for the reason `kernels` gives."""
    op = quantized_matmul_op(QuantizationEncoding[encoding.upper()])
    out = TensorType(DType.float32, [x.shape[0], w.shape[0]], DeviceRef.from_device(x.device))
    return F.custom(op, x.device, [x, w], [out])[0]


class Repacker:
    """Blocks of one GGUF type into the layout `matmul` reads, rows padded to
    `padded_rows`: one small graph per type, compiled in a session of its own."""

    def __init__(self, encodings: set[str]) -> None:
        session = InferenceSession(devices=[CPU()])
        self._models = {e: session.load(self._graph(e)) for e in encodings}

    @staticmethod
    def _graph(encoding: str) -> Graph:
        packed = TensorType(DType.uint8, ["rows", "row_bytes"], DeviceRef.CPU())
        qe = QuantizationEncoding[encoding.upper()]
        with Graph(f"{PACKAGE}_repack_{qe.name}", input_types=[packed]) as graph:
            op = quantized_repack_op(qe)
            graph.output(ops.custom(op, DeviceRef.CPU(), [graph.inputs[0]], [packed])[0])
        return graph

    def __call__(self, encoding: str, blocks: np.ndarray) -> np.ndarray:
        blocks = np.pad(blocks, ((0, padded_rows(blocks.shape[0]) - blocks.shape[0]), (0, 0)))
        return self._models[encoding].execute(Buffer.from_numpy(blocks))[0].to_numpy()
