"""Maps a GPT-2 safetensors checkpoint onto the parameter names of `gpt2.GPT2`.

Two layouts exist in the wild and both load:

- the original hub layout, bare keys (`wte.weight`, `h.0.attn.c_attn.weight`)
  plus the `h.N.attn.bias` / `h.N.attn.masked_bias` causal-mask buffers;
- the layout transformers saves, the same keys under `transformer.` and an
  `lm_head.weight` when the head is untied.

GPT-2 was written with `Conv1D` layers whose weights are stored `[in, out]`;
MAX's `Linear` stores `[out, in]`. That transpose happens here, once at load,
and nowhere else. It also pays at run time: MAX's CPU matmuls are faster on
`[out, in]` weights than `x @ W` on the `[in, out]` originals, and the skinny
decode kernel streams `[out, in]` rows contiguously. Every tensor is then
checked against the shape the config implies, so a truncated or mismatched
checkpoint fails naming the tensor; half-precision tensors become float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from max.dtype import DType
from max.graph.weights import WeightData, Weights

from .hugepages import hugepage_array
from .schema import (
    CAUSAL_MASK_BUFFERS,
    CheckpointError,
    expected_shapes,
    hub_shape,
    is_projection_weight,
)


def _as_float32(name: str, weight: WeightData, transpose: bool) -> WeightData:
    """The tensor as float32 in an array of its own (see `mapping.py`), maybe transposed.

    Float32 because MAX's CPU path has no half precision.
    """
    if not weight.dtype.is_float():
        raise CheckpointError(
            f"tensor {name!r} has dtype {weight.dtype.name}; expected a floating-point tensor."
        )
    if weight.dtype != DType.float32:
        weight = weight.astype(DType.float32)
    array = np.from_dlpack(weight.to_buffer())
    return WeightData.from_numpy(hugepage_array(array.T if transpose else array), name)


def convert_safetensor_state_dict(
    state_dict: dict[str, Weights], huggingface_config: Any, **unused_kwargs: Any
) -> dict[str, WeightData]:
    """Renames, transposes and validates a GPT-2 checkpoint for `gpt2.GPT2`.

    Raises:
        CheckpointError: a tensor is missing, unexpected, or of the wrong shape.
    """
    expected = expected_shapes(huggingface_config)
    converted: dict[str, WeightData] = {}
    for key, weights in state_dict.items():
        name = key.removeprefix("transformer.")
        if CAUSAL_MASK_BUFFERS.fullmatch(name):
            continue
        if name == "lm_head.weight" and name not in expected:
            continue  # A tied head saved anyway: it is `wte.weight` again.
        if name not in expected:
            raise CheckpointError(
                f"unexpected tensor {key!r}: not a GPT2LMHeadModel parameter."
            )
        weight = weights.data()
        stored_shape = hub_shape(name, expected[name])
        shape = tuple(int(d) for d in weight.shape)
        if shape != stored_shape:
            raise CheckpointError(
                f"tensor {key!r} has shape {shape}; the config implies {stored_shape}."
            )
        converted[name] = _as_float32(name, weight, transpose=is_projection_weight(name))
    missing = [name for name in expected if name not in converted]
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s), first "
            f"{missing[0]!r} with shape {expected[missing[0]]}."
        )
    return converted
