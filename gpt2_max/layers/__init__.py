"""GPT-2's layers, and the one place their implementations are chosen: `layers_for`.

The modules are GPT-2's own, one file each as MAX lays its layers out
(`attention.py`, `mlp.py`, `block.py`; the network around them is `gpt2.py`).
They take their parts from a `Layers`, which picks modules and never runs them:
`Layers` gives MAX's own `Linear` and `Embedding`, `GPT2Attention` (MAX's flash
attention), `GPT2Block`, and multiplies a tied head with MAX's matmul: the plain
path, float32, exact against transformers on any device. It is all a copier of
this package needs to bring a model up.

`fast.FastLayers` picks this package's fast modules instead: a Mojo kernel that
streams each weight once per decode step (`linear.py`, `kernels/`), float16
weights held as loaded (`embedding.py`), GGUF blocks multiplied packed
(`quantized.py`), the package's attention op over the paged cache, cheaper than
MAX's at a decode step's one query per sequence, and a whole block as one op
where its weights allow. `layers_for` takes them on the CPU unless
`GPT2_MAX_LAYERS=plain` is set.

On a GPU the plain layers run, in the graph's dtype (bfloat16 by default there):
the package's kernels and the weights it keeps packed or in float16 are CPU-only,
so `Layers.prepare` casts every float tensor to the graph's dtype and dequantizes
packed GGUF blocks, which no plain layer multiplies, at load.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.experimental import nn
from max.experimental.tensor import Tensor
from max.graph import Shape
from max.graph.weights import WeightData

from ..model_config import GPT2ArchConfig
from ..names import PACKAGE
from ..settings import setting
from ..weights.plan import block_type, unpacked
from ..weights.schema import HEAD_WEIGHT
from .attention import GPT2Attention
from .block import GPT2Block

LAYERS_ENV = setting("layers").variable

logger = logging.getLogger("max.pipelines")


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

    def attention(self, layer_idx: int) -> GPT2Attention:
        """Block `layer_idx`'s attention: MAX's flash attention over the paged cache."""
        return GPT2Attention(self.config, self, layer_idx)

    def block(self, layer_idx: int) -> GPT2Block:
        """Block `layer_idx`: its modules one after the other."""
        return GPT2Block(self.config, self, layer_idx)

    def prepare(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The weights in the graph's dtype, each cast from its own.

        MAX compiles a ModuleV3 graph only against weights of the dtype each
        parameter was built in, and records no cast for a local checkpoint whose
        encoding was given, so the cast follows each tensor's dtype, not MAX's
        record: a float32, float16 or bfloat16 tensor becomes `config.dtype`.
        A GGUF's packed blocks are dequantized first, one tensor at a time, so the
        host holds one tensor's float32 beside the result, not the whole model's
        (gpt2-xl's would be 6 GB). Only the CPU's fast layers multiply blocks: here
        a quantized file loads as floats (several times its size: a log line says
        how much) rather than not at all. A tied head's packed copy of the token
        table (`gguf.adapter`) goes: the head multiplies the float table the
        embedding gathers from. The head is padded last (`head_rows`), so the
        padding copies the graph's dtype, not float32.
        """
        config = self.config
        head = state_dict.get(HEAD_WEIGHT)
        if config.head_reads_wte and head is not None and block_type(head):
            state_dict = {name: w for name, w in state_dict.items() if name != HEAD_WEIGHT}
        packed: dict[str, WeightData] = {}
        floats = 0
        prepared = {}
        for name, weight in state_dict.items():
            if block_type(weight) is not None:
                packed[name] = weight
                weight = unpacked(weight)
            weight = weight.astype(config.dtype)
            if name in packed:  # its floats as dequantized, before any padding
                floats += math.prod(int(d) for d in weight.shape) * config.dtype.size_in_bytes
            if name == config.head_weight:
                weight = pad_rows(weight, config.head_rows)
            prepared[name] = weight
        if packed:
            blocks = sum(np.from_dlpack(weight.data).nbytes for weight in packed.values())
            logger.info(
                f"{PACKAGE}: {len(packed)} packed GGUF tensor(s) "
                f"({', '.join(sorted({block_type(w) for w in packed.values()}))}) dequantized "
                f"to {config.dtype.name} at load, as MAX's plain layers multiply floats: "
                f"{blocks / 2**20:.1f} MiB of blocks become {floats / 2**20:.1f} MiB"
            )
        return prepared


def pad_rows(weight: WeightData, rows: int) -> WeightData:
    """`weight` (`[n, ...]`, any float dtype) with zero rows up to `rows`.

    Padded as raw bits of the dtype's width, since numpy holds no bfloat16 (a GPU
    graph's dtype) and all zero bits are 0.0 in every float format."""
    if int(weight.shape[0]) >= rows:
        return weight
    bits = UNSIGNED[weight.dtype.size_in_bytes]
    table = Buffer.from_dlpack(weight.data).view(bits).to_numpy()
    padding = np.zeros((rows - table.shape[0], *table.shape[1:]), dtype=table.dtype)
    padded = Buffer.from_numpy(np.concatenate([table, padding])).view(weight.dtype)
    return WeightData(padded, weight.name, weight.dtype, Shape(padded.shape))


UNSIGNED = {1: DType.uint8, 2: DType.uint16, 4: DType.uint32, 8: DType.uint64}
"""The unsigned integer of each width, to move a float tensor's values as bits."""


def layers_for(config: GPT2ArchConfig) -> Layers:
    """The fast layers where `config.fast_layers`, else MAX's plain ones."""
    if config.fast_layers:
        from .fast import FastLayers

        return FastLayers(config)
    return Layers(config)
