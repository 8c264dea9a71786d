"""The draft: the model's own weights, quantized at load, compiled beside it.

The draft is built by the model's own hooks, in the order MAX's `load_model` calls
them (`_create_model_config` reads the weights plan off the quantized state dict,
`_prepare_state_dict` repacks what MAX's kernel multiplies, `_instantiate_module`
builds the same `GPT2`), so it is the model's graph over packed projections: the
fast layers multiply them as they multiply a GGUF's.

Its keys and values go into pages of its own, as many as the model's cache has and
addressed through the model's page table: a row's draft entries sit in the pages MAX
gave the row, so MAX's allocation, eviction and reuse of pages bound the draft's too
and nothing needs freeing. Which of a row's tokens the draft's pages hold is the
extension's to track (`model.Speculation`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import gguf
import numpy as np
from max import tree
from max.driver import Buffer
from max.experimental import functional as F
from max.experimental.tensor import default_dtype
from max.graph.weights import WeightData

from ..bursts.model import step_inputs
from ..gguf.quants import quantize
from ..inputs import GPT2Inputs
from ..names import PACKAGE
from ..settings import setting
from ..weights.hugepages import hugepage_array
from ..weights.plan import block_type, packed_weight
from ..weights.schema import is_projection_weight, ties_word_embeddings

logger = logging.getLogger("max.pipelines")

ENV = setting("draft").variable


def float_weight(weight: WeightData) -> np.ndarray:
    """`weight` as float32, its GGUF blocks dequantized if it is packed."""
    kind = block_type(weight)
    if kind is None:
        return np.asarray(weight.data).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    return gguf.quants.dequantize(np.asarray(weight.data), qtype).astype(np.float32)


def quantized_state(state: dict[str, WeightData], kind: str, tied: bool) -> dict[str, WeightData]:
    """`state` (the model's weights as its adapter loaded them) with the matrices a
    decode step streams (the blocks' projections, the head) packed as `kind`: a tied
    head multiplies a packed copy of the token table, which is still gathered as
    floats, as a quantized GGUF's is (`gguf.adapter`).

    Raises:
        ValueError: a matrix's rows are not whole blocks of `kind`.
    """
    qtype = gguf.GGMLQuantizationType[kind.upper()]

    def packed(name: str, weight: WeightData) -> WeightData:
        try:
            blocks = quantize(float_weight(weight), qtype)
        except ValueError as error:
            raise ValueError(
                f"{ENV}={kind}: cannot pack {name} {tuple(weight.shape)} as {kind} "
                f"({error}); name a block type whose blocks divide it, such as q4_0 or q8_0."
            ) from error
        return packed_weight(hugepage_array(blocks), name, kind)

    draft = {
        name: packed(name, weight) if is_projection_weight(name) or name == "lm_head.weight"
        else weight
        for name, weight in state.items()
    }
    if tied and "lm_head.weight" not in draft:
        draft["lm_head.weight"] = packed("lm_head.weight", state["wte.weight"])
    return draft


class Draft:
    """The compiled draft and the pages it writes."""

    def __init__(self, model: Any, kind: str) -> None:
        """Quantizes `model`'s weights to `kind` and compiles the draft (a second
        compile, cached by MAX as the model's is)."""
        tied = ties_word_embeddings(model.huggingface_config)
        state = quantized_state(model._load_state_dict(), kind, tied)
        config = model._create_model_config(state)
        state = model._prepare_state_dict(state, config)
        logger.info(f"{PACKAGE}: compiling the draft ({ENV}={kind})")
        with F.lazy(), default_dtype(model._module_default_dtype(state, config)):
            module = model._instantiate_module(config)
        self._graph: Callable[..., Any] = module.compile(
            *model._get_compile_input_types(config), weights=state
        )
        self.kv_params = config.kv_params
        self.kind = kind
        self._blocks: Buffer | None = None

    def _pages(self, first: GPT2Inputs) -> Buffer:
        """The draft's pages: as many as the model's cache has, allocated once."""
        if self._blocks is None:
            (kv,) = first.kv_cache_inputs
            shape = (int(kv.kv_blocks.shape[0]), *self.kv_params.shape_per_block)
            self._blocks = Buffer(shape=shape, dtype=self.kv_params.dtype,
                                  device=first.tokens.device)
            logger.info(
                f"{PACKAGE}: the draft's cache takes %.0f MiB beside the model's",
                self._blocks.num_elements * self.kv_params.dtype.size_in_bytes / 2**20,
            )
        return self._blocks

    def logits(self, first: GPT2Inputs, rows: Sequence[np.ndarray], starts: np.ndarray
               ) -> np.ndarray:
        """The draft's next-token logits (`[len(rows), vocab]`) after each row's tokens
        `rows[r]`, placed from position `starts[r]`, where the row's draft cache ends."""
        inputs = step_inputs(first, self.kv_params, rows, starts, kv_blocks=self._pages(first))
        # Raw, as the model's own steps run (`cpu_runtime`): no `Tensor` wrapping.
        out = tree.unflatten(self._graph.out_tree, self._graph.execute_raw(*inputs.buffers))
        return out.next_token_logits.to_numpy()
