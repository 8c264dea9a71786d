"""Writes GPT-2 as a GGUF file the way llama.cpp's converter and quantizer do.

Tensor names, layouts and metadata follow llama.cpp's `gpt2` architecture
(`convert_hf_to_gguf.py` `GPT2Model`): `Conv1D` weights are transposed to
`[out, in]` (numpy order; ggml calls it `ne = [in, out]`), so quantization
blocks run along the input dimension; 1-D tensors (norms, biases) stay F32
whatever the file type, and position embeddings are never quantized. The
tokenizer goes into the file's metadata, so the file alone is a servable model.

    python -m gpt2_max.tools.checkpoint out --preset gpt2 --format gguf --type q4_k_m
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType
from transformers import GPT2Config

from ..gguf.names import gguf_name
from ..gguf.quants import QK_K, quantize
from ..weights.schema import CAUSAL_MASK_BUFFERS, is_projection_weight

"""Block layers the hub stores `[in, out]`; GGUF stores them `[out, in]`."""

def _use_more_bits(layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in `_M` mixes."""
    return (
        layer < n_layer // 8
        or layer >= 7 * n_layer // 8
        or (layer - n_layer // 8) % 3 == 2
    )


TypePolicy = Callable[[str, int, int, bool], Q]
"""(gguf name, layer or -1, n_layer, file has `output.weight`) -> tensor type."""


def _pure(qtype: Q) -> TypePolicy:
    return lambda name, layer, n_layer, has_output: qtype


def _q4_k_m(name: str, layer: int, n_layer: int, has_output: bool) -> Q:
    """llama.cpp's Q4_K_M recipe for GPT-2's tensors."""
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        return Q.Q6_K
    if name.endswith("attn_qkv.weight"):
        return Q.Q5_K
    if name.endswith("ffn_down.weight") and _use_more_bits(layer, n_layer):
        return Q.Q6_K
    return Q.Q4_K


FILE_TYPES: dict[str, tuple[TypePolicy, LlamaFileType]] = {
    "f32": (_pure(Q.F32), LlamaFileType.ALL_F32),
    "f16": (_pure(Q.F16), LlamaFileType.MOSTLY_F16),
    "q8_0": (_pure(Q.Q8_0), LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (_pure(Q.Q4_0), LlamaFileType.MOSTLY_Q4_0),
    "q4_k": (_pure(Q.Q4_K), LlamaFileType.MOSTLY_Q4_K_S),
    "q6_k": (_pure(Q.Q6_K), LlamaFileType.MOSTLY_Q6_K),
    "q4_k_m": (_q4_k_m, LlamaFileType.MOSTLY_Q4_K_M),
}
"""`--type` values: the per-tensor type rule and the `general.file_type` it declares."""

K_FALLBACK: dict[Q, Q] = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
"""llama.cpp's substitute where a row is not a multiple of 256 (gpt2-xl's 1600)."""


def tensor_type(
    name: str, shape: tuple[int, ...], file_type: str, n_layer: int, has_output: bool
) -> Q:
    """The GGUF type `file_type` gives tensor `name` of numpy shape `shape`."""
    if len(shape) < 2:
        return Q.F32
    qtype = FILE_TYPES[file_type][0](name, _layer(name), n_layer, has_output)
    if name == "position_embd.weight" and qtype not in (Q.F32, Q.F16):
        return Q.F32
    if qtype in K_FALLBACK and shape[-1] % QK_K:
        return K_FALLBACK[qtype]
    return qtype


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def add_gpt2_metadata(writer: gguf.GGUFWriter, config: GPT2Config, file_type: str) -> None:
    writer.add_name("GPT-2")
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_file_type(FILE_TYPES[file_type][1])


def add_tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer_dir: Path) -> None:
    """GPT-2's byte-level BPE as llama.cpp's `gpt2` tokenizer model reads it."""
    vocab: dict[str, int] = json.loads((tokenizer_dir / "vocab.json").read_text())
    added = json.loads((tokenizer_dir / "tokenizer.json").read_text())["added_tokens"]
    control = {t["id"] for t in added if t.get("special")}
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if vocab[t] in control else gguf.TokenType.NORMAL for t in tokens]
    )
    gguf.SpecialVocab(tokenizer_dir, load_merges=True).add_to_gguf(writer, quiet=True)


def gguf_tensors(
    config: GPT2Config, hub_state: dict[str, np.ndarray], file_type: str
) -> dict[str, tuple[np.ndarray, Q]]:
    """`hub_state` (hub names and layout, float) as llama.cpp tensors: name ->
    (float32/float16 array or uint8 blocks `[rows, row_bytes]`, type)."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown GGUF type {file_type!r}; expected one of {sorted(FILE_TYPES)}")
    tensors: dict[str, np.ndarray] = {}
    for hub_name, array in hub_state.items():
        hub_name = hub_name.removeprefix("transformer.")
        if CAUSAL_MASK_BUFFERS.fullmatch(hub_name):
            continue
        if hub_name == "lm_head.weight" and getattr(config, "tie_word_embeddings", True):
            continue
        array = np.asarray(array, dtype=np.float32)
        if is_projection_weight(hub_name):
            array = np.ascontiguousarray(array.T)
        tensors[gguf_name(hub_name)] = array
    has_output = "output.weight" in tensors
    typed = {}
    for name, array in tensors.items():
        qtype = tensor_type(name, array.shape, file_type, config.n_layer, has_output)
        typed[name] = (quantize(array, qtype), qtype)
    return typed


def write_tensors(
    path: Path,
    config: GPT2Config,
    tensors: dict[str, tuple[np.ndarray, Q]],
    file_type: str,
    tokenizer_dir: Path,
    architecture: str = "gpt2",
) -> Path:
    """Writes GPT-2 metadata, the tokenizer and `tensors` (see `gguf_tensors`) to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, architecture)
    add_gpt2_metadata(writer, config, file_type)
    add_tokenizer_metadata(writer, tokenizer_dir)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf(
    path: Path,
    config: GPT2Config,
    hub_state: dict[str, np.ndarray],
    file_type: str,
    tokenizer_dir: Path,
) -> Path:
    """Writes `hub_state` (hub names and layout, float) as a llama.cpp GPT-2 GGUF."""
    tensors = gguf_tensors(config, hub_state, file_type)
    return write_tensors(path, config, tensors, file_type, tokenizer_dir)
