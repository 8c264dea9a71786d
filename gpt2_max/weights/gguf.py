"""Maps a llama.cpp GPT-2 GGUF onto the parameters of `gpt2.GPT2`.

llama.cpp's names (`token_embd`, `blk.N.attn_qkv`, ...) become the module's hub
names; its matmul weights are already `[out, in]`, the layout MAX's `Linear`
and `qmatmul` take, so nothing is transposed. Per tensor type:

- F32 loads as is. F16 matrices a decode step streams (block matmul weights, an
  untied head, the token table that also serves a tied head) stay float16, half
  the bytes per token: the skinny kernel widens them in registers, for decode
  and prefill alike, and the embedding widens the rows it gathers (`linear.py`,
  `embedding.py`).
  Other F16 tensors (position table, norms, biases: small) and all BF16 ones
  are widened to float32 here (MAX's CPU kernels have no bfloat16).
  Safetensors checkpoints in float16 are widened by their own adapter.
- Q4_0, Q4_K and Q6_K matmul weights stay packed: MAX has CPU kernels for
  them (`quantized.py`). Embedding tables are dequantized to float32 at load:
  gathering packed rows and dequantizing them in the graph crashed MAX 26.7's
  Q4_0 kernel on a GPT-2-sized table. A tied head still multiplies the packed
  token table: the adapter hands it over as `lm_head.weight` too.
- Other block types (Q8_0, Q5_0, Q4_1, Q5_1, Q5_K, ...) have no MAX kernel; the
  `gguf` package dequantizes them to float32 here, and one log line lists them.
  MAX's own GGUF reader refuses Q8_0/Q5_0/Q4_1 outright, so their bytes are read
  through the `gguf` reader MAX opened.
- A type nothing can read fails the start naming the tensor and its type.

MAX 26.7 builds a model's config only from `config.json` (before any plugin code
runs), so a GGUF is served from a folder holding it with a `config.json` and
tokenizer files: `python -m gpt2_max.weights.gguf FILE.gguf` derives both from
the file's metadata. The adapter checks that metadata against `config.json`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import mmap
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from max.graph import Shape
from max.graph.quantization import QuantizationEncoding
from max.graph.weights import GGUFWeights, WeightData, Weights
from transformers import GPT2Config

from ..quantized import padded_rows
from ..shims.internals import gguf_reader
from ..tokenizer import copy_tokenizer
from .gguf_names import block_part, hub_name
from .hugepages import hugepage_array
from .safetensors import CheckpointError, expected_shapes

logger = logging.getLogger("max.pipelines")

KERNEL_ENCODINGS: dict[Q, QuantizationEncoding] = {
    Q.Q4_0: QuantizationEncoding.Q4_0,
    Q.Q4_K: QuantizationEncoding.Q4_K,
    Q.Q6_K: QuantizationEncoding.Q6_K,
}
"""Block types MAX can multiply (`qmatmul`) and gather-dequantize on the CPU."""

WIDENED = (Q.F16, Q.BF16)
"""Float types read exactly (widened to float32 unless `stays_half`)."""

PACKABLE = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
"""Block layers whose weights may stay packed; so may an untied `lm_head`."""

def stays_packed(name: str) -> bool:
    """Whether a quantized tensor `name` is used packed (by a matmul)."""
    return name == "lm_head.weight" or (
        name.endswith(".weight") and block_part(name) in PACKABLE
    )


def stays_half(name: str) -> bool:
    """Whether an F16 tensor `name` is held as float16: a matmul weight, or the
    token table (a tied head streams it every decode step)."""
    return name == "wte.weight" or stays_packed(name)


_libc = ctypes.CDLL(None, use_errno=True)


def release_pages(weights: GGUFWeights) -> None:
    """Returns the file's pages to the kernel once every tensor has been copied out.

    `GGUFWeights` has no `close()`: its reader keeps the whole file mapped for
    the life of the process, and the pages the adapter read stay resident
    beside the copies the model holds (`hugepage_array`). `MADV_DONTNEED` drops
    them from this process; the mapping is a read-only view of the file, so a
    later read would fault them back in from it.
    """
    data = gguf_reader(weights).data
    if data.nbytes:
        address = ctypes.c_void_p(data.ctypes.data)
        if _libc.madvise(address, ctypes.c_size_t(data.nbytes), mmap.MADV_DONTNEED):
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) on the GGUF mapping")


def metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The file's key-value metadata (token arrays may be skipped by MAX's reader)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _expect(meta: dict[str, Any], key: str, value: Any, field: str) -> None:
    if key in meta and not np.isclose(meta[key], value, rtol=1e-6, atol=0):
        raise CheckpointError(
            f"GGUF metadata {key}={meta[key]} disagrees with config.json {field}={value}."
        )


def check_architecture(meta: dict[str, Any]) -> None:
    arch = meta.get("general.architecture")
    if arch != "gpt2":
        raise CheckpointError(
            f"this GGUF holds a {arch!r} model (general.architecture); gpt2_max "
            "serves llama.cpp's 'gpt2' architecture."
        )


def check_metadata(meta: dict[str, Any], hf_config: Any) -> None:
    """Refuses a GGUF that is not GPT-2 or whose shape metadata disagrees with `hf_config`."""
    check_architecture(meta)
    for key, value, field in (
        ("gpt2.block_count", hf_config.n_layer, "n_layer"),
        ("gpt2.embedding_length", hf_config.n_embd, "n_embd"),
        ("gpt2.attention.head_count", hf_config.n_head, "n_head"),
        ("gpt2.feed_forward_length", hf_config.n_inner or 4 * hf_config.n_embd, "n_inner"),
        ("gpt2.context_length", hf_config.n_positions, "n_positions"),
        ("gpt2.attention.layer_norm_epsilon", hf_config.layer_norm_epsilon, "layer_norm_epsilon"),
    ):
        _expect(meta, key, value, field)


def _float32(name: str, tensor: gguf.ReaderTensor) -> np.ndarray:
    """A tensor as float32 in numpy order, dequantized by the `gguf` package if packed."""
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, KeyError, ValueError) as error:
        raise CheckpointError(
            f"tensor {tensor.name!r} ({name}) has GGML type {tensor.tensor_type.name}, "
            f"which neither MAX nor the gguf package can read: {error}"
        ) from error
    return writable(np.asarray(array, dtype=np.float32))


def writable(array: np.ndarray) -> np.ndarray:
    """A contiguous copy DLPack can export (the reader's memory map is read-only), in
    huge pages: see `hugepages.py`."""
    return hugepage_array(array)


def _packed(name: str, weights: Weights) -> WeightData:
    """A quantized matrix as its blocks, rows padded for MAX's kernels (`padded_rows`)."""
    packed = weights.data()
    blocks = np.asarray(packed.data)
    rows = padded_rows(blocks.shape[0])
    if rows != blocks.shape[0]:
        blocks = np.pad(blocks, ((0, rows - blocks.shape[0]), (0, 0)))
    return WeightData(
        writable(blocks), name, packed.dtype, Shape(blocks.shape), packed.quantization_encoding
    )


def convert_gguf_state_dict(
    state_dict: dict[str, Weights], huggingface_config: Any, **unused_kwargs: Any
) -> dict[str, WeightData]:
    """Renames, validates and (where MAX has no kernel) dequantizes a GPT-2 GGUF.

    Raises:
        CheckpointError: another architecture, disagreeing metadata, a missing,
            unexpected or wrongly shaped tensor, or an unreadable tensor type.
    """
    if not state_dict:
        raise CheckpointError("the GGUF file holds no tensors.")
    reader = gguf_reader(next(iter(state_dict.values())))
    check_metadata(metadata(reader), huggingface_config)
    tensors = {t.name: t for t in reader.tensors}
    expected = expected_shapes(huggingface_config)
    converted: dict[str, WeightData] = {}
    dequantized: list[str] = []
    for key in state_dict:
        name = hub_name(key)
        if name == "lm_head.weight" and name not in expected:
            continue  # A tied head written anyway: it is `wte.weight` again.
        if name is None or name not in expected:
            raise CheckpointError(f"unexpected tensor {key!r}: not a llama.cpp GPT-2 tensor.")
        tensor = tensors[key]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if shape != expected[name]:
            raise CheckpointError(
                f"tensor {key!r} has shape {shape}; the config implies {expected[name]}."
            )
        qtype = tensor.tensor_type
        if qtype in KERNEL_ENCODINGS and stays_packed(name):
            converted[name] = _packed(name, state_dict[key])
            continue
        if qtype in KERNEL_ENCODINGS and name == "wte.weight" and "lm_head.weight" not in expected:
            # A tied head over a packed table multiplies the blocks (a float copy
            # would cost 4-8x their bytes per decode step); the gather below
            # reads float rows.
            converted["lm_head.weight"] = _packed("lm_head.weight", state_dict[key])
        if qtype == Q.F16 and stays_half(name):
            converted[name] = WeightData.from_numpy(writable(np.asarray(tensor.data)), name)
            continue
        if qtype not in (Q.F32, *WIDENED):
            dequantized.append(f"{key} ({qtype.name})")
        converted[name] = WeightData.from_numpy(_float32(key, tensor), name)
    missing = [name for name in expected if name not in converted]
    if missing:
        raise CheckpointError(
            f"GGUF is missing {len(missing)} tensor(s), first {missing[0]!r} "
            f"with shape {expected[missing[0]]}."
        )
    if dequantized:
        logger.info(
            "gpt2_max: no MAX kernel for %d GGUF tensor(s), dequantized to float32 at "
            "load: %s",
            len(dequantized),
            ", ".join(dequantized),
        )
    return converted


def huggingface_config(meta: dict[str, Any], tensor_names: set[str]) -> GPT2Config:
    """The transformers config a llama.cpp GPT-2 GGUF implies.

    GGUF has no fields for `activation_function`, `scale_attn_weights`,
    `scale_attn_by_inverse_layer_idx` or `reorder_and_upcast_attn`; llama.cpp
    computes GPT-2's defaults (tanh GELU, 1/sqrt(head_dim)), and so does this.
    """
    n_embd = int(meta["gpt2.embedding_length"])
    tokens = meta.get("tokenizer.ggml.tokens")
    # Stored as float32: its shortest decimal is what was written (1e-05).
    epsilon = np.float32(meta.get("gpt2.attention.layer_norm_epsilon", 1e-5))
    return GPT2Config(
        architectures=["GPT2LMHeadModel"],
        n_layer=int(meta["gpt2.block_count"]),
        n_embd=n_embd,
        n_head=int(meta["gpt2.attention.head_count"]),
        n_inner=int(meta.get("gpt2.feed_forward_length", 4 * n_embd)),
        n_positions=int(meta["gpt2.context_length"]),
        layer_norm_epsilon=float(str(epsilon)),
        vocab_size=len(tokens) if tokens else 50257,
        bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 50256)),
        eos_token_id=int(meta.get("tokenizer.ggml.eos_token_id", 50256)),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def write_tokenizer(meta: dict[str, Any], folder: Path) -> None:
    """GPT-2 tokenizer files from the file's `gpt2` tokenizer, else the vendored ones."""
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if meta.get("tokenizer.ggml.model") != "gpt2" or not tokens or not merges:
        copy_tokenizer(folder)
        return
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    eos = tokens[int(meta.get("tokenizer.ggml.eos_token_id", len(tokens) - 1))]
    bos = tokens[int(meta.get("tokenizer.ggml.bos_token_id", len(tokens) - 1))]
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": bos,
                "eos_token": eos,
                "unk_token": eos,
                "add_prefix_space": False,
            }
        )
    )


def write_companion_files(path: Path) -> Path:
    """Writes `config.json` and tokenizer files beside the GGUF at `path`."""
    reader = gguf.GGUFReader(path)
    meta = metadata(reader)
    check_architecture(meta)
    config = huggingface_config(meta, {t.name for t in reader.tensors})
    config.to_json_file(path.parent / "config.json")
    write_tokenizer(meta, path.parent)
    return path.parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Writes config.json and tokenizer files beside a GPT-2 GGUF, "
        "so `max serve --model <its folder>` can serve it."
    )
    parser.add_argument("gguf_file", type=Path)
    folder = write_companion_files(parser.parse_args(argv).gguf_file)
    print(f"wrote config.json and tokenizer files to {folder}")


if __name__ == "__main__":
    main()
