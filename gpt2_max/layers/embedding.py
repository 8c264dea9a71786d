"""An embedding table held in the dtype it was loaded in, its rows widened as gathered.

An F16 GGUF's token table stays float16 in memory: it is GPT-2's largest matrix, and
the tied LM head streams it every decode step (`linear.project` reads float16 weights).
Only the gathered rows become float32, the dtype the rest of the graph computes in.
"""

from __future__ import annotations

from max.dtype import DType
from max.experimental import nn
from max.experimental.tensor import Tensor


class Embedding(nn.Embedding):
    """MAX's `Embedding` with its table in `dtype`, returning float32 rows."""

    def __init__(self, vocab_size: int, *, dim: int, dtype: DType = DType.float32) -> None:
        super().__init__(vocab_size, dim=dim)
        if dtype != self.weight.dtype:
            self.weight = Tensor.zeros([vocab_size, dim], dtype=dtype)

    def forward(self, indices: Tensor) -> Tensor:
        rows = super().forward(indices)
        return rows if rows.dtype == DType.float32 else rows.cast(DType.float32)
