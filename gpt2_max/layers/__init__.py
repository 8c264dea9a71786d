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
per sequence. `layers_for` takes them on the CPU unless `GPT2_MAX_LAYERS=plain` is set.

On a GPU the plain layers run, in the graph's dtype (bfloat16 by default there):
the package's kernels and the weights it keeps packed or in float16 are CPU-only,
so `Layers.prepare` casts every float tensor to the graph's dtype and refuses
packed blocks, which no plain layer multiplies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from max.experimental import nn
from max.experimental.nn.common_layers.functional_kernels import flash_attention_ragged
from max.experimental.tensor import Tensor
from max.graph.weights import WeightData
from max.nn.attention import MHAMaskVariant
from max.nn.kv_cache import PagedCacheValues

from ..model_config import GPT2ArchConfig
from ..settings import setting, settings
from ..weights.plan import block_type
from ..weights.schema import CheckpointError

LAYERS_ENV = setting("layers").variable


class Layers:
    """MAX's plain layers; every parameter in the graph's dtype (`config.dtype`)."""

    def __init__(self, config: GPT2ArchConfig) -> None:
        self.config = config

    def linear(self, name: str, in_dim: int, out_dim: int, *, bias: bool = True) -> nn.Module:
        """The linear layer whose parameters are `{name}.weight` (`[out, in]`) and `{name}.bias`."""
        return nn.Linear(in_dim, out_dim, bias=bias)

    def embedding(self, name: str, rows: int, dim: int) -> nn.Module:
        """The table `{name}.weight`, returning rows in the graph's dtype."""
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

    def block(
        self, block: Any, x: Tensor, kv_collection: PagedCacheValues, input_row_offsets: Tensor
    ) -> Tensor:
        """A transformer block (`gpt2.GPT2Block`) applied to `x`: its modules one after
        the other (`GPT2Block.composed`)."""
        return block.composed(x, kv_collection, input_row_offsets)

    def prepare(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The weights in the graph's dtype, each cast from its own.

        MAX compiles a ModuleV3 graph only against weights of the dtype each
        parameter was built in, and records no cast for a local checkpoint whose
        encoding was given, so the cast follows each tensor's dtype, not MAX's
        record: a float32, float16 or bfloat16 tensor becomes `config.dtype`.

        Raises:
            CheckpointError: a tensor is packed GGUF blocks, which only the CPU's
                fast layers multiply.
        """
        dtype = self.config.dtype
        for name, weight in state_dict.items():
            if (kind := block_type(weight)) is not None:
                raise CheckpointError(
                    f"tensor {name!r} is packed as {kind}; "
                    f"the plain layers multiply float tensors only. Serve this file on the "
                    f"CPU (`--devices cpu`) without {LAYERS_ENV}=plain, or a float file."
                )
        if (head := self.config.head_weight) in state_dict:
            state_dict = {**state_dict, head: pad_rows(state_dict[head], self.config.head_rows)}
        return {
            name: weight if weight.dtype == dtype else weight.astype(dtype)
            for name, weight in state_dict.items()
        }


def pad_rows(weight: WeightData, rows: int) -> WeightData:
    """`weight` (`[n, ...]`, a float dtype numpy holds) with zero rows up to `rows`."""
    if int(weight.shape[0]) >= rows:
        return weight
    table = np.from_dlpack(weight.data)
    padding = np.zeros((rows - table.shape[0], *table.shape[1:]), dtype=table.dtype)
    return WeightData.from_numpy(np.concatenate([table, padding]), weight.name)


def uses_fast_layers(on_cpu: bool) -> bool:
    """Whether the package's fast layers serve: on the CPU, unless `LAYERS_ENV` says plain."""
    return on_cpu and settings().layers == "fast"


def layers_for(config: GPT2ArchConfig) -> Layers:
    """The fast layers where `uses_fast_layers`, else MAX's plain ones."""
    if uses_fast_layers(config.devices[0].is_cpu()):
        from .fast import FastLayers

        return FastLayers(config)
    return Layers(config)
