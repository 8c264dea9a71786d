"""Turns a batch of request contexts into one ragged `GPT2Inputs`.

GPT-2's positions are learned embeddings, so besides the tokens the graph needs
each token's absolute position. A context's active window starts where its KV
cache ends (`tokens.processed_length`): at zero for a fresh prompt, further on
after a prefix-cache hit or an earlier prefill chunk, and at the newest token
when decoding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from max import tree
from max.driver import Buffer
from max.dtype import DType
from max.graph import BufferType, DeviceRef, TensorType
from max.nn.kv_cache import KVCacheInputs
from max.nn.kv_cache.cache_params import KVCacheParamInterface
from max.pipelines.context import TextContext
from max.pipelines.lib.interfaces.batch_processor import (
    ModuleV3SingleReplicaBatchProcessor,
    build_single_replica_ragged_token_arrays,
    ragged_batch_inputs,
    single_replica_context_batch,
)

from .inputs import GPT2Inputs
from .names import PACKAGE
from .shims.internals import processing_offset


def position_ids(contexts: Sequence[TextContext]) -> np.ndarray:
    """Absolute positions of every context's active tokens, concatenated.

    Raises:
        ValueError: a context has a processing offset (see below).
    """
    for ctx in contexts:
        # With a processing offset, `tokens.active` starts `offset` tokens after
        # `processed_length` while `current_position` ends `offset` tokens early,
        # so the range below would be wrong. Nothing in MAX 26.7 sets one, and
        # only a private field tells (see `shims.internals`).
        if offset := processing_offset(ctx.tokens):
            raise ValueError(
                f"request {ctx.request_id} has processing offset "
                f"{offset}; {PACKAGE} positions assume none."
            )
    return np.concatenate(
        [
            np.arange(ctx.tokens.processed_length, ctx.tokens.current_position)
            for ctx in contexts
        ]
    ).astype(np.int64)


class GPT2BatchProcessor(ModuleV3SingleReplicaBatchProcessor[TextContext, GPT2Inputs]):
    """Ragged batching with learned-position ids, one replica, one device."""

    def get_symbolic_inputs(
        self, *, kv_params: KVCacheParamInterface, device_refs: list[DeviceRef]
    ) -> list[TensorType | BufferType]:
        device = device_refs[0]
        ragged = ragged_batch_inputs(device, ("tokens", "return_n_logits", "row_offsets"))
        positions = TensorType(DType.int64, shape=["total_seq_len"], device=device)
        return [
            ragged["tokens"],
            positions,
            ragged["return_n_logits"],
            ragged["row_offsets"],
            *tree.leaves(kv_params.get_symbolic_inputs()),
        ]

    def prepare_initial_token_inputs(
        self,
        replica_batches: Sequence[Sequence[TextContext]],
        kv_cache_inputs: KVCacheInputs[Buffer, Buffer] | None = None,
        return_n_logits: int = 1,
    ) -> GPT2Inputs:
        contexts = single_replica_context_batch(
            replica_batches, processor_name=type(self).__qualname__
        )
        tokens, row_offsets = build_single_replica_ragged_token_arrays(contexts)
        device = self.runtime.devices[0]
        return GPT2Inputs(
            tokens=Buffer.from_numpy(tokens).to(device),
            position_ids=Buffer.from_numpy(position_ids(contexts)).to(device),
            return_n_logits=Buffer.from_numpy(
                np.array([return_n_logits], dtype=np.int64)
            ),
            input_row_offsets=Buffer.from_numpy(row_offsets).to(device),
            kv_cache_inputs=kv_cache_inputs,
            contexts=contexts,
        )
