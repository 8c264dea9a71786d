"""The layers `gpt2.GPT2` is built from, chosen in one place: `layers_for`.

`Layers` builds MAX's own `Linear` and `Embedding` and multiplies a tied head
with MAX's matmul: the plain path, float32, exact against transformers on any
device. It is all a copier of this package needs to bring a model up.

`fast.FastLayers` is the same interface with this package's fast paths behind
it: a Mojo kernel that streams each weight once per decode step
(`linear.py`, `kernels/`), float16 weights held as loaded (`embedding.py`),
GGUF blocks multiplied packed by MAX's quantized CPU kernels (`quantized.py`).
On the CPU, attention over the paged cache is the package's own Mojo op
(`kernels/mojo/attention.mojo`), cheaper than MAX's at a decode step's one query
per sequence. `layers_for` takes them on the CPU, and wherever the weights are held in a
form plain layers cannot hold (packed or float16).
"""

from __future__ import annotations

from typing import Any

from max.experimental import nn
from max.experimental.nn.common_layers.functional_kernels import flash_attention_ragged
from max.experimental.tensor import Tensor
from max.nn.attention import MHAMaskVariant
from max.nn.kv_cache import PagedCacheValues

from ..model_config import GPT2ArchConfig


class Layers:
    """MAX's plain layers; every parameter float32."""

    def __init__(self, config: GPT2ArchConfig) -> None:
        self.config = config

    def linear(self, name: str, in_dim: int, out_dim: int, *, bias: bool = True) -> nn.Module:
        """The linear layer whose parameters are `{name}.weight` (`[out, in]`) and `{name}.bias`."""
        return nn.Linear(in_dim, out_dim, bias=bias)

    def embedding(self, name: str, rows: int, dim: int) -> nn.Module:
        """The table `{name}.weight`, returning float32 rows."""
        return nn.Embedding(rows, dim=dim)

    def tied_head(self, h: Tensor, table: Tensor) -> Tensor:
        """`h @ table.T`: logits from the token table itself (a tied LM head)."""
        return h @ table.T

    def attention(
        self, q: Tensor, input_row_offsets: Tensor, kv_collection: PagedCacheValues,
        layer_idx: Tensor, scale: float,
    ) -> Tensor:
        """Causal attention of `q` (`[tokens, heads, head_dim]`, a ragged batch) over
        layer `layer_idx` of the paged KV cache, which already holds the step's keys
        and values: MAX's flash attention, on any device."""
        return flash_attention_ragged(
            self.config.kv_params,
            input=q,
            input_row_offsets=input_row_offsets,
            kv_collection=kv_collection,
            layer_idx=layer_idx,
            mask_variant=MHAMaskVariant.CAUSAL_MASK,
            scale=scale,
        )

    def prepare(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The weights as these layers read them (plain layers read them as loaded)."""
        return state_dict


def layers_for(config: GPT2ArchConfig) -> Layers:
    """The fast layers on the CPU or for weights held packed or in float16; else plain."""
    if config.devices[0].is_cpu() or not config.weights.is_plain:
        from .fast import FastLayers

        return FastLayers(config)
    return Layers(config)
