"""GPT-2's parameters as every reader and writer of its weights sees them.

The module tree of `gpt2.GPT2` keeps the Hugging Face hub names, so one table
serves the safetensors and GGUF adapters, the GGUF writer and the random
checkpoint writer: every parameter's name and its shape in MAX's `[out, in]`
layout. The hub stores the four block projections (transformers' `Conv1D`)
`[in, out]`; `hub_shape` says so, and the safetensors adapter transposes them,
once, at load. A checkpoint that does not fit the table raises `CheckpointError`
naming the tensor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from max.driver import is_virtual_device_mode
from max.dtype import DType

PROJECTIONS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
"""A block's linear layers: `Conv1D` on the hub, the matrices a decode step
streams, and the ones GGUF files quantize."""

HEAD_WEIGHT = "lm_head.weight"
"""An untied LM head's matrix, or a tied one a quantized GGUF hands over packed."""

CAUSAL_MASK_BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
"""Constant mask buffers older checkpoints carry; attention masks in-kernel."""

_BLOCK_PARAMETER = re.compile(r"h\.(\d+)\.(.+)\.(weight|bias)")


def feed_forward_size(hf_config: Any) -> int:
    """The MLP's inner width: `n_inner`, or transformers' `4 * n_embd` when it is null."""
    return getattr(hf_config, "n_inner", None) or 4 * hf_config.n_embd


def ties_word_embeddings(hf_config: Any) -> bool:
    """Whether the LM head reuses `wte`: transformers ties it unless told otherwise."""
    return getattr(hf_config, "tie_word_embeddings", True)


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match its config."""


def is_projection_weight(name: str) -> bool:
    """Whether `name` (`h.3.mlp.c_fc.weight`) is a block projection's weight matrix."""
    match = _BLOCK_PARAMETER.fullmatch(name)
    return match is not None and match.group(3) == "weight" and match.group(2) in PROJECTIONS


def block_index(name: str) -> int | None:
    """The block a parameter (`h.3.mlp.c_fc.weight`) belongs to, or None outside the blocks."""
    match = _BLOCK_PARAMETER.fullmatch(name)
    return None if match is None else int(match.group(1))


def hub_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """How a hub checkpoint stores parameter `name` of `shape` (`Conv1D`: transposed)."""
    return shape[::-1] if is_projection_weight(name) else shape


def parameter_count(hf_config: Any) -> int:
    """How many values GPT-2's parameters hold (`expected_shapes`)."""
    return sum(math.prod(shape) for shape in expected_shapes(hf_config).values())


def expected_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter `gpt2.GPT2` needs, in MAX's `[out, in]` layout, in module order."""
    hidden, vocab = hf_config.n_embd, hf_config.vocab_size
    inner = feed_forward_size(hf_config)
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (vocab, hidden),
        "wpe.weight": (hf_config.n_positions, hidden),
        "ln_f.weight": (hidden,),
        "ln_f.bias": (hidden,),
    }
    for i in range(hf_config.n_layer):
        for name, shape in {
            "ln_1.weight": (hidden,),
            "ln_1.bias": (hidden,),
            "attn.c_attn.weight": (3 * hidden, hidden),
            "attn.c_attn.bias": (3 * hidden,),
            "attn.c_proj.weight": (hidden, hidden),
            "attn.c_proj.bias": (hidden,),
            "ln_2.weight": (hidden,),
            "ln_2.bias": (hidden,),
            "mlp.c_fc.weight": (inner, hidden),
            "mlp.c_fc.bias": (inner,),
            "mlp.c_proj.weight": (hidden, inner),
            "mlp.c_proj.bias": (hidden,),
        }.items():
            shapes[f"h.{i}.{name}"] = shape
    if not ties_word_embeddings(hf_config):
        shapes[HEAD_WEIGHT] = (vocab, hidden)
    return shapes


def match_tensors(
    found: Iterable[tuple[str, str | None, tuple[int, ...]]],
    hf_config: Any,
    *,
    hub_layout: bool,
    source: str,
    foreign: str,
) -> list[tuple[str, str]]:
    """The rule every checkpoint format is held to, in one place: which of its tensors
    load, as which parameter.

    `found` holds each tensor's key in the file, the parameter name it maps to
    (None for a key that names none) and its shape as the file stores it
    (`hub_shape`'s where `hub_layout`). A tied head saved anyway is dropped (it is
    `wte.weight` again); every other tensor must be a parameter of the config's
    shape, and none may be missing. `source` names the file in errors.

    Returns:
        (key, parameter name) of each tensor to load, in file order.

    Raises:
        CheckpointError: an unexpected (`foreign`: what it is not), wrongly shaped
            or missing tensor, naming it.
    """
    found = list(found)
    blocks = 1 + max(
        (int(m.group(1)) for _, name, _ in found
         if name is not None and (m := _BLOCK_PARAMETER.fullmatch(name))),
        default=-1,
    )
    if hf_config.n_layer > blocks:  # before listing n_layer blocks' parameters
        raise CheckpointError(
            f"{source} holds the tensors of {blocks} block(s); the config's n_layer "
            f"is {hf_config.n_layer}."
        )
    if blocks > hf_config.n_layer:  # a parameter of a block past them, not a foreign one
        key = next(key for key, name, _ in found if name is not None
                   and (m := _BLOCK_PARAMETER.fullmatch(name)) and int(m.group(1)) == blocks - 1)
        raise CheckpointError(
            f"{source} holds tensors of block {blocks - 1} ({key!r}); the config's n_layer "
            f"is {hf_config.n_layer}."
        )
    expected = expected_shapes(hf_config)
    matched = []
    for key, name, shape in found:
        if name == HEAD_WEIGHT and name not in expected:
            continue
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {key!r}: not a {foreign}.")
        stored = hub_shape(name, expected[name]) if hub_layout else expected[name]
        if shape != stored:
            raise CheckpointError(
                f"tensor {key!r} has shape {shape}; the config implies {stored}."
            )
        matched.append((key, name))
    loaded = {name for _, name in matched}
    if missing := [name for name in expected if name not in loaded]:
        why = ""
        if missing == [HEAD_WEIGHT]:
            why = (" The config sets tie_word_embeddings to false, so the head is a tensor"
                   " of its own; a checkpoint saved tied loads with the config's default.")
        raise CheckpointError(
            f"{source} is missing {len(missing)} tensor(s), first {missing[0]!r} "
            f"with shape {expected[missing[0]]}.{why}"
        )
    return matched


def check_finite(state_dict: Mapping[str, Any]) -> None:
    """Raises `CheckpointError` naming the first float parameter of an adapter's output
    (`WeightData`) that holds a NaN or an infinity. Such a checkpoint (a fine-tune that
    diverged, a float16 overflow at save) loads everywhere and answers with NaN logits:
    tokens sampled from nothing, and NaN log-probabilities that JSON writes as null.
    Packed GGUF blocks are not read: their scales lie inside the blocks, and finding
    them would cost a dequantization at every start. Nor is anything read where MAX
    compiles for a device it does not have (`max warm-cache --target`): there MAX's
    `WeightData.astype`, which widens a half-precision folder's tensors at load
    (`safetensors._as_float32`), gives a buffer it leaves uninitialized, whose bytes
    are no checkpoint's and at times read as a NaN."""
    if is_virtual_device_mode():
        return
    for name, weight in state_dict.items():
        if weight.dtype not in (DType.float32, DType.float16):
            continue
        values = np.from_dlpack(weight.data)
        with np.errstate(over="ignore", invalid="ignore"):  # a pass without a mask's memory
            if np.isfinite(values.sum(dtype=np.float32)):
                continue
        nan = int(np.count_nonzero(np.isnan(values)))
        infinite = int(np.count_nonzero(np.isinf(values)))
        if nan or infinite:
            raise CheckpointError(
                f"tensor {name!r} holds {nan} NaN and {infinite} infinite value(s) of "
                f"{values.size}: the checkpoint is damaged, and every logit would be NaN."
            )
