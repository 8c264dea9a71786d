"""The fast paths, behind the plain `Layers` interface (see `layers/__init__.py`).

Each parameter gets the layer that holds it as the weights plan says: packed
GGUF blocks a `QuantizedLinear`, float matrices (float32 or float16) a
`SkinnyLinear`, tables an `Embedding` in their loaded dtype. Projections and a
tied head go through `linear.project`, which streams the weights through the
skinny Mojo kernel at decode sizes and uses MAX's matmul for float32 prefills.
A block whose projections are float runs as one op (`block`), which saves MAX's
cost between ops at every decode step (`docs/performance.md`, "One op a block").
"""

from __future__ import annotations

from typing import Any

from max.driver import CPU
from max.dtype import DType
from max.experimental import functional as F
from max.experimental import nn
from max.experimental.tensor import Tensor
from max.nn.kv_cache import PagedCacheValues

from .. import kernels
from ..settings import settings
from . import Layers
from .embedding import Embedding
from .linear import SkinnyLinear, project
from .quantized import QuantizedLinear, repack


class FastLayers(Layers):
    """Layers for the weights as loaded, through this package's kernels."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.fuse_blocks = settings().fuse_blocks

    def block(
        self, block: Any, x: Tensor, kv_collection: PagedCacheValues, input_row_offsets: Tensor
    ) -> Tensor:
        """The block as one op (`kernels.decoder_block`) where its shape allows: float
        projections of one dtype with biases, a tanh GELU, as many key heads as query
        heads; else its modules."""
        attn, mlp = block.attn, block.mlp
        projections = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
        if not (
            self.fuse_blocks
            and self.config.activation == "gelu_tanh"
            and all(isinstance(p, SkinnyLinear) and isinstance(p.bias, Tensor) for p in projections)
            and len({p.weight.dtype for p in projections}) == 1
            and all(n.weight.dtype == DType.float32 for n in (block.ln_1, block.ln_2))
        ):
            return super().block(block, x, kv_collection, input_row_offsets)
        layer_idx = F.constant(attn.layer_idx, DType.uint32, device=CPU())
        c_attn, c_proj, c_fc, mlp_proj = ((p.weight, p.bias) for p in projections)
        return kernels.decoder_block(
            x, (block.ln_1.weight, block.ln_1.bias, block.ln_1.eps), c_attn, c_proj,
            (block.ln_2.weight, block.ln_2.bias), c_fc, mlp_proj,
            input_row_offsets, kv_collection, layer_idx, attn.scale, attn.head_dim,
        )

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
