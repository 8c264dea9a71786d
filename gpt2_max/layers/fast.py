"""The fast paths, behind the plain `Layers` interface (see `layers/__init__.py`).

Each parameter gets the layer that holds it as the weights plan says: packed
GGUF blocks a `QuantizedLinear`, float matrices (float32 or float16) a
`SkinnyLinear`, tables an `Embedding` in their loaded dtype. Projections and a
tied head go through `linear.project`, which streams the weights through the
skinny Mojo kernel at decode sizes and uses MAX's matmul for float32 prefills.
"""

from __future__ import annotations

from typing import Any

from max.experimental import nn
from max.experimental.tensor import Tensor
from max.nn.kv_cache import PagedCacheValues

from .. import kernels
from . import Layers
from .embedding import Embedding
from .linear import SkinnyLinear, project
from .quantized import QuantizedLinear, repack


class FastLayers(Layers):
    """Layers for the weights as loaded, through this package's kernels."""

    def linear(self, name: str, in_dim: int, out_dim: int, *, bias: bool = True) -> nn.Module:
        weight = f"{name}.weight"
        encoding = self.config.weights.encoding(weight)
        if encoding is not None:
            return QuantizedLinear(in_dim, out_dim, encoding, bias=bias)
        return SkinnyLinear(in_dim, out_dim, bias=bias, dtype=self.config.weights.dtype(weight))

    def embedding(self, name: str, rows: int, dim: int) -> nn.Module:
        return Embedding(rows, dim=dim, dtype=self.config.weights.dtype(f"{name}.weight"))

    def tied_head(self, h: Tensor, table: Tensor) -> Tensor:
        return project(h, table)

    def attention(
        self, q: Tensor, input_row_offsets: Tensor, kv_collection: PagedCacheValues,
        layer_idx: Tensor, scale: float,
    ) -> Tensor:
        """The package's op over the paged cache (CPU only, as the fast layers are)."""
        return kernels.paged_attention(q, input_row_offsets, kv_collection, layer_idx, scale)

    def prepare(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return repack(state_dict)
