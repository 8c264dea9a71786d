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
- Matmul weights of the block types `encodings.PACKED_TYPES` lists stay packed:
  MAX's `qmatmul` or the package's kernel multiplies Q4_0, Q4_K and Q6_K,
  whichever `layers/kernel_choice.py` timed the faster on this CPU, the package's
  alone Q5_K, Q5_0, Q5_1 and Q8_0 (`layers/quantized.py`). MAX's own GGUF reader refuses
  Q5_0, Q5_1 and Q8_0 (its `QuantizationEncoding` has none), so their bytes are
  read through the `gguf` reader MAX opened and travel as `plan.BlockWeightData`.
  Embedding tables are dequantized to float32 at
  load: gathering packed rows and dequantizing them in the graph crashed MAX
  26.7's Q4_0 kernel on a GPT-2-sized table. A tied head still multiplies the packed
  token table: the adapter hands it over as `lm_head.weight` too, unless the file
  holds a packed `output.weight` of its own (`table_is_head`).
- Other block types (Q4_1, IQ types, ...) have no kernel here; the `gguf`
  package dequantizes them to float32 here, and one log line lists them.
- A type nothing can read fails the start naming the tensor and its type.

MAX 26.7 builds a model's config only from `config.json` (before any plugin code
runs), so a GGUF is served from a folder holding it with a `config.json` and
tokenizer files: `gpt2-max-gguf-config FILE.gguf` (`gpt2_max.tools.gguf_config`)
derives both from the file's metadata. The adapter checks that metadata against `config.json`.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import mmap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from max.graph.weights import GGUFWeights, WeightData, Weights
from transformers import GPT2Config

from ..encodings import PACKED_TYPES
from ..names import PACKAGE
from ..shims.internals import gguf_reader
from ..weights.hugepages import hugepage_array
from ..weights.plan import packed_weight
from ..weights.schema import (
    HEAD_WEIGHT,
    CheckpointError,
    expected_shapes,
    feed_forward_size,
    is_projection_weight,
    match_tensors,
    ties_word_embeddings,
)
from .names import hub_name

logger = logging.getLogger("max.pipelines")

KEPT: frozenset[Q] = frozenset(Q[name.upper()] for name in PACKED_TYPES)
"""Block types whose matmul weights stay packed (`encodings.PACKED_TYPES`)."""

WIDENED = (Q.F16, Q.BF16)
"""Float types read exactly (widened to float32 unless `stays_half`)."""

BOS, EOS = "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"
GPT2_DEFAULTS = GPT2Config()
"""What a GGUF without tokenizer metadata gets: GPT-2's own vocabulary and special ids."""


def stays_packed(name: str) -> bool:
    """Whether a quantized tensor `name` is used packed (by a matmul)."""
    return name == HEAD_WEIGHT or is_projection_weight(name)


def stays_half(name: str) -> bool:
    """Whether an F16 tensor `name` is held as float16: a matmul weight, or the
    token table (a tied head streams it every decode step)."""
    return name == "wte.weight" or stays_packed(name)


class Held(enum.Enum):
    """How the adapter hands a tensor over."""

    PACKED = "its blocks, as the file holds them"
    HALF = "float16, as the file holds it"
    FLOAT32 = "float32: read exactly, widened or dequantized"


def held_as(name: str, qtype: Q, tied_head: bool) -> tuple[tuple[str, Held], ...]:
    """The parameters the adapter makes of tensor `name` of type `qtype`, and how each
    is held: the one rule the adapter follows and the memory planner counts by."""
    if qtype in KEPT and stays_packed(name):
        return ((name, Held.PACKED),)
    if qtype in KEPT and name == "wte.weight" and tied_head:
        # A tied head over a packed table multiplies the blocks (a float copy would
        # cost 4-8x their bytes per decode step); the gather reads float rows.
        return ((HEAD_WEIGHT, Held.PACKED), (name, Held.FLOAT32))
    if qtype == Q.F16 and stays_half(name):
        return ((name, Held.HALF),)
    return ((name, Held.FLOAT32),)


def table_is_head(tensors: Sequence[gguf.ReaderTensor], hf_config: Any) -> bool:
    """Whether the LM head multiplies the token table: under a config that ties them,
    unless the file holds a packed `output.weight`, which is then the head.

    llama.cpp's converter writes GPT-2's tied head as `output.weight`, a copy of the
    table, and its quantizer gives that copy a type of its own (Q6_K where the table
    is Q4_K); llama.cpp multiplies by it. A folder's `config.json` from the hub ties
    them all the same (`gpt2-max-gguf-config` writes one that does not). A float
    `output.weight` is the table again and is dropped, as a tied head saved anyway."""
    return ties_word_embeddings(hf_config) and not any(
        tensor.name == "output.weight" and tensor.tensor_type in KEPT for tensor in tensors
    )


def head_is_table(paths: Sequence[Path], hf_config: Any) -> bool:
    """`table_is_head` of the GGUF `paths`, read from their headers: the model's config
    ties the head to the table only where the files hold no packed head of their own."""
    return all(table_is_head(gguf.GGUFReader(path).tensors, hf_config) for path in paths)


def held_bytes(paths: Sequence[Path], hf_config: Any) -> int:
    """Bytes the adapter hands over for the GGUF `paths`, read from their headers: what
    the fast layers hold (`memory_planner.held_excess`); tensors that are not GPT-2's,
    which the load refuses, and a head the table serves, count nothing."""
    total = 0
    for path in paths:
        tensors = gguf.GGUFReader(path).tensors
        tied_head = table_is_head(tensors, hf_config)
        for tensor in tensors:
            name = hub_name(tensor.name)
            if name == HEAD_WEIGHT and tied_head:
                continue
            for _, form in held_as(name, tensor.tensor_type, tied_head) if name else ():
                total += (
                    int(tensor.n_bytes) if form is Held.PACKED
                    else int(tensor.n_elements) * (2 if form is Held.HALF else 4)
                )
    return total


def metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The file's key-value metadata (token arrays may be skipped by MAX's reader)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _expect(meta: dict[str, Any], key: str, value: Any, field: str) -> None:
    if key in meta and not np.isclose(meta[key], value, rtol=1e-6, atol=0):
        raise CheckpointError(
            f"GGUF metadata {key}={meta[key]} disagrees with config.json {field}={value}."
        )


def huggingface_config(meta: dict[str, Any], tensor_names: set[str]) -> GPT2Config:
    """The transformers config a llama.cpp GPT-2 GGUF implies.

    GGUF has no fields for `activation_function`, `scale_attn_weights`,
    `scale_attn_by_inverse_layer_idx` or `reorder_and_upcast_attn`; llama.cpp
    computes GPT-2's defaults (tanh GELU, 1/sqrt(head_dim)), and so does this.
    """
    n_embd = int(meta["gpt2.embedding_length"])
    tokens = meta.get("tokenizer.ggml.tokens")
    inner = meta.get("gpt2.feed_forward_length")
    # Stored as float32: its shortest decimal is what was written (1e-05).
    epsilon = np.float32(meta.get("gpt2.attention.layer_norm_epsilon", 1e-5))
    return GPT2Config(
        architectures=["GPT2LMHeadModel"],
        n_layer=int(meta["gpt2.block_count"]),
        n_embd=n_embd,
        n_head=int(meta["gpt2.attention.head_count"]),
        n_inner=None if inner is None else int(inner),  # None: transformers' 4 * n_embd
        n_positions=int(meta["gpt2.context_length"]),
        layer_norm_epsilon=float(str(epsilon)),
        vocab_size=len(tokens) if tokens else GPT2_DEFAULTS.vocab_size,
        bos_token_id=int(meta.get(BOS, GPT2_DEFAULTS.bos_token_id)),
        eos_token_id=int(meta.get(EOS, GPT2_DEFAULTS.eos_token_id)),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def check_architecture(meta: dict[str, Any]) -> None:
    arch = meta.get("general.architecture")
    if arch != "gpt2":
        raise CheckpointError(
            f"this GGUF holds a {arch!r} model (general.architecture); {PACKAGE} "
            "serves llama.cpp's 'gpt2' architecture."
        )


def check_metadata(meta: dict[str, Any], hf_config: Any) -> None:
    """Refuses a GGUF that is not GPT-2 or whose shape metadata disagrees with `hf_config`."""
    check_architecture(meta)
    for key, value, field in (
        ("gpt2.block_count", hf_config.n_layer, "n_layer"),
        ("gpt2.embedding_length", hf_config.n_embd, "n_embd"),
        ("gpt2.attention.head_count", hf_config.n_head, "n_head"),
        ("gpt2.feed_forward_length", feed_forward_size(hf_config), "n_inner"),
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


def _packed(name: str, tensor: gguf.ReaderTensor) -> WeightData:
    """A quantized matrix as its blocks (`uint8`, one row per output feature), with
    MAX's `QuantizationEncoding` where it names the type."""
    return packed_weight(writable(np.asarray(tensor.data)), name, tensor.tensor_type.name)


def _own_head(tensor: gguf.ReaderTensor, hf_config: Any) -> WeightData:
    """The file's packed `output.weight` as the head of a config that ties it
    (`table_is_head`), where `match_tensors` drops a tied head."""
    shape, table = tuple(int(d) for d in reversed(tensor.shape)), expected_shapes(hf_config)
    if shape != table["wte.weight"]:
        raise CheckpointError(
            f"tensor 'output.weight' has shape {shape}; the config implies "
            f"{table['wte.weight']}."
        )
    return _packed(HEAD_WEIGHT, tensor)


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
    found = (
        (key, hub_name(key), tuple(int(d) for d in reversed(tensors[key].shape.tolist())))
        for key in state_dict
    )
    tied_head = table_is_head(reader.tensors, huggingface_config)
    converted: dict[str, WeightData] = {}
    if ties_word_embeddings(huggingface_config) and not tied_head:
        converted[HEAD_WEIGHT] = _own_head(tensors["output.weight"], huggingface_config)
    dequantized: list[str] = []
    for key, name in match_tensors(
        found, huggingface_config, hub_layout=False, source="GGUF",
        foreign="llama.cpp GPT-2 tensor",
    ):
        tensor = tensors[key]
        for parameter, form in held_as(name, tensor.tensor_type, tied_head):
            if form is Held.PACKED:
                converted[parameter] = _packed(parameter, tensor)
            elif form is Held.HALF:
                converted[parameter] = WeightData.from_numpy(
                    writable(np.asarray(tensor.data)), parameter
                )
            else:
                if tensor.tensor_type not in (Q.F32, *WIDENED):
                    dequantized.append(f"{key} ({tensor.tensor_type.name})")
                converted[parameter] = WeightData.from_numpy(_float32(key, tensor), parameter)
    if dequantized:
        logger.info(
            f"{PACKAGE}: %d GGUF tensor(s) dequantized to float32 at load (embedding tables "
            "are gathered as float rows; other types have no packed kernel): %s",
            len(dequantized),
            ", ".join(dequantized),
        )
    logger.info(
        f"{PACKAGE}: the GGUF's weights take %.0f MiB in memory (the file: %.0f MiB)",
        sum(np.asarray(w.data).nbytes for w in converted.values()) / 2**20,
        reader.data.nbytes / 2**20,
    )
    return converted


_libc = ctypes.CDLL(None, use_errno=True)


def release_pages(weights: GGUFWeights) -> None:
    """Returns the file's pages to the kernel once every tensor has been copied out.

    `GGUFWeights` has no `close()`: its reader keeps the whole file mapped for
    the life of the process, and the pages the adapter read stay resident
    beside the copies the model holds (`writable`). `MADV_DONTNEED` drops
    them from this process; the mapping is a read-only view of the file, so a
    later read would fault them back in from it.
    """
    data = gguf_reader(weights).data
    if data.nbytes:
        address = ctypes.c_void_p(data.ctypes.data)
        if _libc.madvise(address, ctypes.c_size_t(data.nbytes), mmap.MADV_DONTNEED):
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) on the GGUF mapping")
