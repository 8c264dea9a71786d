"""GPT-2's causal self-attention over MAX's paged KV cache."""

from __future__ import annotations

from typing import Any

from max.driver import CPU
from max.dtype import DType
from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.nn.common_layers.functional_kernels import flash_attention_ragged
from max.experimental.tensor import Tensor
from max.nn import kernels
from max.nn.attention import MHAMaskVariant
from max.nn.kv_cache import PagedCacheValues

from ..model_config import GPT2ArchConfig

# Write one layer's new keys / values (`[tokens, heads, head_dim]`) into the paged cache.
store_k_cache_ragged = F.functional(kernels.store_k_cache_ragged)
store_v_cache_ragged = F.functional(kernels.store_v_cache_ragged)


class GPT2Attention(Module[..., Tensor]):
    """Causal multi-head self-attention: one QKV projection, the step's keys and values
    stored in the paged cache, attention over everything cached for each sequence
    (`attend`: MAX's flash attention, on any device), the output projection."""

    def __init__(self, config: GPT2ArchConfig, layers: Any, layer_idx: int) -> None:
        self.kv_params = config.kv_params
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale(layer_idx)
        prefix = f"h.{layer_idx}.attn"
        self.c_attn = layers.linear(f"{prefix}.c_attn", config.hidden_size, 3 * config.hidden_size)
        self.c_proj = layers.linear(f"{prefix}.c_proj", config.hidden_size, config.hidden_size)

    def forward(
        self, x: Tensor, kv_collection: PagedCacheValues, input_row_offsets: Tensor
    ) -> Tensor:
        layer_idx = F.constant(self.layer_idx, DType.uint32, device=CPU())
        heads = [-1, self.num_heads, self.head_dim]
        q, k, v = F.split(self.c_attn(x), [self.num_heads * self.head_dim] * 3, axis=1)
        store_k_cache_ragged(kv_collection, k.reshape(heads), input_row_offsets, layer_idx)
        store_v_cache_ragged(kv_collection, v.reshape(heads), input_row_offsets, layer_idx)
        attn = self.attend(q.reshape(heads), input_row_offsets, kv_collection, layer_idx)
        return self.c_proj(attn.reshape([-1, self.num_heads * self.head_dim]))

    def attend(
        self, q: Tensor, input_row_offsets: Tensor, kv_collection: PagedCacheValues,
        layer_idx: Tensor,
    ) -> Tensor:
        """Causal attention of `q` (`[tokens, heads, head_dim]`, a ragged batch) over
        this layer of the paged KV cache, which already holds the step's keys and
        values."""
        return flash_attention_ragged(
            self.kv_params,
            input=q,
            input_row_offsets=input_row_offsets,
            kv_collection=kv_collection,
            layer_idx=layer_idx,
            mask_variant=MHAMaskVariant.CAUSAL_MASK,
            scale=self.scale,
        )
