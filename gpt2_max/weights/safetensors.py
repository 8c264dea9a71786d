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
from .schema import CAUSAL_MASK_BUFFERS, CheckpointError, is_projection_weight, match_tensors


def _as_float32(name: str, weight: WeightData, transpose: bool) -> WeightData:
    """The tensor as float32 in an array of its own (see `formats.py`), maybe transposed.

    Float32 is exact for float16 and bfloat16 tensors and is what the CPU's graph
    reads (MAX's CPU path has no half precision); the plain layers cast it on to a
    GPU graph's bfloat16 (`layers.Layers.prepare`).
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
    data = {
        key: weights.data() for key, weights in state_dict.items()
        if not CAUSAL_MASK_BUFFERS.fullmatch(key.removeprefix("transformer."))
    }
    found = [
        (key, key.removeprefix("transformer."), tuple(int(d) for d in weight.shape))
        for key, weight in data.items()
    ]
    return {
        name: _as_float32(name, data[key], transpose=is_projection_weight(name))
        for key, name in match_tensors(
            found, huggingface_config, hub_layout=True, source="checkpoint",
            foreign="GPT2LMHeadModel parameter",
        )
    }
