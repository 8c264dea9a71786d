"""The fast modules, picked by `FastLayers` where `Layers` picks MAX's plain ones.

Each parameter gets the layer that holds it as the weights plan says: packed
GGUF blocks a `QuantizedLinear`, float matrices (float32 or float16) a
`SkinnyLinear`, tables an `Embedding` in their loaded dtype. Projections and a
tied head go through `linear.project`, which streams the weights through the
skinny Mojo kernel at decode sizes and uses MAX's matmul for float32 prefills.
Attention is the package's op over the paged cache (`PackageAttention`). A block
whose projections are float, or all packed on the package's kernel, is a `FusedBlock`,
one op, which saves MAX's cost between ops at every decode step
(`docs/performance.md`, "One op a block"); its float16 weights are held in lines
(`kernels.lines`), read only by that op, where lines stream faster on this CPU
(`lines_choice`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from max.driver import CPU
from max.dtype import DType
from max.experimental import functional as F
from max.experimental import nn
from max.experimental.tensor import Tensor
from max.graph import Shape
from max.graph.weights import WeightData
from max.nn.kv_cache import PagedCacheValues

from .. import kernels
from ..settings import settings
from ..weights.hugepages import hugepage_array
from ..weights.schema import PROJECTIONS, block_index, is_projection_weight
from . import Layers
from .attention import GPT2Attention
from .block import GPT2Block
from .embedding import Embedding
from .kernel_choice import one_op
from .linear import SkinnyLinear, project
from .lines_choice import float16_lines
from .quantized import QuantizedLinear, repack


def held_in_lines(dtype: DType, row_lengths: list[int]) -> bool:
    """Whether a `FusedBlock`'s float weights of `dtype`, rows of `row_lengths` values,
    are held in lines: where lines can hold them (`kernels.in_lines`) and stream faster
    on this CPU (`lines_choice`, measured only then)."""
    return kernels.in_lines(dtype, row_lengths) and float16_lines()


class PackageAttention(GPT2Attention):
    """`GPT2Attention` attending through the package's op over the paged cache
    (`kernels/mojo/attention.mojo`; CPU only, as the fast layers are)."""

    def attend(
        self, q: Tensor, input_row_offsets: Tensor, kv_collection: PagedCacheValues,
        layer_idx: Tensor,
    ) -> Tensor:
        return kernels.paged_attention(q, input_row_offsets, kv_collection, layer_idx, self.scale)


class FusedBlock(GPT2Block):
    """`GPT2Block` computed as one op (`kernels.decoder_block`, `kernels/mojo/block.mojo`):
    the same parameters under the same names, the same value as the modules compute.
    `FastLayers.block` builds one only where the op covers the block's shape."""

    def forward(
        self, x: Tensor, kv_collection: PagedCacheValues, input_row_offsets: Tensor
    ) -> Tensor:
        attn, mlp = self.attn, self.mlp
        layer_idx = F.constant(attn.layer_idx, DType.uint32, device=CPU())
        projections = (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj)
        c_attn, c_proj, c_fc, mlp_proj = ((p.weight, p.bias) for p in projections)
        rows = [int(p.weight.shape[1]) for p in projections]
        lined = held_in_lines(attn.c_attn.weight.dtype, rows)
        return kernels.decoder_block(
            x, (self.ln_1.weight, self.ln_1.bias, self.ln_1.eps), c_attn, c_proj,
            (self.ln_2.weight, self.ln_2.bias), c_fc, mlp_proj,
            input_row_offsets, kv_collection, layer_idx, attn.scale, attn.head_dim,
            encodings=tuple(getattr(p, "encoding", None) for p in projections),
            lined=lined,
        )


class FastLayers(Layers):
    """The modules for the weights as loaded, through this package's kernels."""

    def block(self, layer_idx: int) -> GPT2Block:
        return (FusedBlock if self.fuses(layer_idx) else GPT2Block)(self.config, self, layer_idx)

    def fuses(self, layer_idx: int) -> bool:
        """Whether block `layer_idx` is a `FusedBlock`, which the op covers: a tanh GELU,
        float32 LayerNorms, and projections (each with its bias) either float of one
        dtype or all packed in types the package's kernel multiplies and takes for a
        block on this CPU at the weights' work (`kernel_choice.one_op`)."""
        config = self.config
        weights = config.weights
        names = [f"h.{layer_idx}.{p}.weight" for p in PROJECTIONS]
        encodings = [weights.encoding(name) for name in names]
        if not any(encodings):
            covered = len({weights.dtype(name) for name in names}) == 1
        else:
            covered = all(e is not None and one_op(e, weights.work) for e in encodings)
        return (
            covered
            and settings().fuse_blocks
            and config.activation == "gelu_tanh"
            and config.dtype == DType.float32
        )

    def work_of(self, weight: str) -> str:
        """What packed `weight`'s kernel is chosen for (`kernel_choice.WORK`): "block" in
        a `FusedBlock`, whose op multiplies it with the package's kernel; else as the
        weights plan says."""
        if (layer := block_index(weight)) is not None and self.fuses(layer):
            return "block"
        return self.config.weights.work_of(weight)

    def attention(self, layer_idx: int) -> GPT2Attention:
        return PackageAttention(self.config, self, layer_idx)

    def linear(self, name: str, in_dim: int, out_dim: int, *, bias: bool = True) -> nn.Module:
        weight = f"{name}.weight"
        encoding = self.config.weights.encoding(weight)
        if encoding is not None:
            return QuantizedLinear(in_dim, out_dim, encoding, bias=bias, work=self.work_of(weight))
        return SkinnyLinear(in_dim, out_dim, bias=bias, dtype=self.config.weights.dtype(weight))

    def embedding(self, name: str, rows: int, dim: int) -> nn.Module:
        return Embedding(rows, dim=dim, dtype=self.config.weights.dtype(f"{name}.weight"))

    def tied_head(self, h: Tensor, table: Tensor) -> Tensor:
        return project(h, table)

    def prepare(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Packed weights in their kernels' layouts (`repack`); a `FusedBlock`'s float16
        weights in lines (`kernels.lines`), as its op reads them (`kernels.in_lines`)."""
        prepared = dict(repack(state_dict, self.work_of))
        layers = {block_index(name) for name in prepared if is_projection_weight(name)}
        for layer in sorted(layers):
            names = [f"h.{layer}.{p}.weight" for p in PROJECTIONS]
            weights = [prepared.get(name) for name in names]
            if any(w is None for w in weights) or not (self.fuses(layer) and held_in_lines(
                    weights[0].dtype, [int(w.shape[1]) for w in weights])):
                continue
            for name, weight in zip(names, weights, strict=True):
                held = hugepage_array(kernels.lines(np.asarray(weight.data)))
                prepared[name] = WeightData(held, name, weight.dtype, Shape(held.shape))
        return prepared
