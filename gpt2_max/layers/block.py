"""GPT-2's transformer block: pre-LayerNorm attention and MLP with residual connections."""

from __future__ import annotations

from typing import Any

from max.dtype import DType
from max.experimental.nn import Module
from max.experimental.nn.norm import LayerNorm
from max.experimental.tensor import Tensor
from max.nn.kv_cache import PagedCacheValues

from ..model_config import GPT2ArchConfig
from .mlp import GPT2MLP


def layer_norm(config: GPT2ArchConfig) -> LayerNorm:
    """A LayerNorm over the hidden size whose mean and variance are reduced in
    float32 whatever the graph's dtype, as MAX's own architectures normalize in
    bfloat16 (in a float32 graph that is the plain LayerNorm)."""
    return LayerNorm(
        config.hidden_size,
        eps=config.layer_norm_epsilon,
        keep_dtype=config.dtype == DType.float32,
    )


class GPT2Block(Module[..., Tensor]):
    """`x + attn(ln_1(x))`, then `+ mlp(ln_2(x))`; the attention module is the layers'
    choice (`Layers.attention`)."""

    def __init__(self, config: GPT2ArchConfig, layers: Any, layer_idx: int) -> None:
        self.ln_1 = layer_norm(config)
        self.attn = layers.attention(layer_idx)
        self.ln_2 = layer_norm(config)
        self.mlp = GPT2MLP(config, layers, layer_idx)

    def forward(
        self, x: Tensor, kv_collection: PagedCacheValues, input_row_offsets: Tensor
    ) -> Tensor:
        x = x + self.attn(self.ln_1(x), kv_collection, input_row_offsets)
        return x + self.mlp(self.ln_2(x))
