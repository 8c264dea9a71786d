"""`GPT2ArchConfig`: the fields of a Hugging Face `GPT2Config` that shape the MAX graph.

`initialize` runs before any weight is read or graph is built (memory planning
calls it too), so an unsupported checkpoint is refused here, with a message that
names the field, instead of failing somewhere inside compilation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import KVCacheParams
from max.nn.transformer import ReturnLogits
from max.pipelines.kv_cache import cache_dtype_for_encoding
from max.pipelines.lib import KVCacheConfig, MAXModelConfig, PipelineConfig
from max.pipelines.lib.interfaces.arch_config import (
    ArchConfigWithKVCache,
    ArchConfigWithStoredKVParams,
)
from max.pipelines.modeling.config_enums import (
    SupportedEncoding,
    supported_encoding_dtype,
)
from transformers import AutoConfig, AutoTokenizer, GPT2Config
from typing_extensions import Self, override

from . import encodings
from .names import PACKAGE
from .settings import settings
from .shims.internals import quantization_encoding
from .weights.files import VOCABULARY_FILES, tokenizer_files_named
from .weights.formats import check_complete, head_is_table
from .weights.plan import WeightPlan
from .weights.schema import HEAD_WEIGHT, CheckpointError, feed_forward_size, ties_word_embeddings

#: The `activation_function` values transformers accepts for GPT-2, mapped to the
#: name `gpt2.activation` implements. The three tanh-approximated GELUs are one
#: formula under different names.
ACTIVATIONS: dict[str, str] = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "linear": "linear",
}


GPT2_VOCAB_SIZE: int = GPT2Config().vocab_size
"""The vocabulary every GPT-2 family member and the vendored tokenizer share."""


def usable_vocab_size(model_vocab_size: int, tokenizer_vocab_size: int) -> int:
    """The token ids both the embedding table and the tokenizer know.

    Fine-tunes often pad the embedding matrix past the tokenizer's vocabulary;
    those rows can be neither typed in nor decoded, so they are refused as input
    and never sampled.
    """
    return min(model_vocab_size, tokenizer_vocab_size)


@functools.cache
def tokenizer_vocab_size(model_path: str, revision: str | None, trust_remote_code: bool) -> int:
    """`len()` of the tokenizer MAX loads for `model_path` (cached: config init runs often).

    Raises:
        CheckpointError: the tokenizer files of the folder `model_path` do not load,
            naming the file (or the files) to restore (`weights.files.tokenizer_files_named`).
    """
    folder = Path(model_path)
    if folder.is_dir() and not any((folder / name).is_file() for name in VOCABULARY_FILES):
        raise CheckpointError(
            f"{folder} holds no tokenizer ({' or '.join(VOCABULARY_FILES)}, with "
            "merges.txt): transformers builds an empty one from such a folder, which "
            "reads every prompt as no tokens. Copy the model's own tokenizer files there."
        )
    with tokenizer_files_named(model_path):
        return len(
            AutoTokenizer.from_pretrained(
                model_path, revision=revision, trust_remote_code=trust_remote_code
            )
        )


class UnsupportedCheckpointError(ValueError):
    """The checkpoint's config asks for something this package does not compute."""


def validate_huggingface_config(hf_config: Any) -> None:
    """Refuses configs whose math this GPT-2 graph would get wrong.

    Raises:
        UnsupportedCheckpointError: naming the offending field.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type != "gpt2":
        raise UnsupportedCheckpointError(
            f"{PACKAGE} serves GPT-2 checkpoints (model_type 'gpt2'); this config "
            f"has model_type {model_type!r}."
        )
    if getattr(hf_config, "add_cross_attention", False):
        raise UnsupportedCheckpointError(
            "add_cross_attention=True makes GPT-2 an encoder-decoder component; "
            f"{PACKAGE} serves decoder-only language models."
        )
    activation = hf_config.activation_function
    if activation not in ACTIVATIONS:
        raise UnsupportedCheckpointError(
            f"activation_function {activation!r} is not supported; expected one "
            f"of {sorted(ACTIVATIONS)}."
        )
    for name in ("n_embd", "n_head", "n_layer", "n_positions", "vocab_size"):
        value = getattr(hf_config, name, None)
        if not isinstance(value, int) or value <= 0:
            raise UnsupportedCheckpointError(
                f"config field {name} must be a positive integer, got {value!r}."
            )
    if hf_config.n_embd % hf_config.n_head:
        raise UnsupportedCheckpointError(
            f"n_embd ({hf_config.n_embd}) must be divisible by n_head "
            f"({hf_config.n_head})."
        )
    epsilon = hf_config.layer_norm_epsilon
    if not isinstance(epsilon, int | float) or not 0 < epsilon < math.inf:
        raise UnsupportedCheckpointError(
            f"layer_norm_epsilon must be a positive number, got {epsilon!r}: MAX's layer "
            "norm takes no other."
        )
    n_inner = getattr(hf_config, "n_inner", None)
    if n_inner is not None and (not isinstance(n_inner, int) or n_inner <= 0):
        raise UnsupportedCheckpointError(
            f"n_inner must be null or a positive integer, got {n_inner!r}."
        )


def shape_fields(hf_config: Any) -> dict[str, Any]:
    """The fields of `GPT2ArchConfig` a (validated) transformers config decides: the
    model's shape and math, everything but the serving settings."""
    return {
        "vocab_size": hf_config.vocab_size,
        "hidden_size": hf_config.n_embd,
        "num_layers": hf_config.n_layer,
        "num_heads": hf_config.n_head,
        "head_dim": hf_config.n_embd // hf_config.n_head,
        "feed_forward_size": feed_forward_size(hf_config),
        "max_positions": hf_config.n_positions,
        "layer_norm_epsilon": hf_config.layer_norm_epsilon,
        "activation": ACTIVATIONS[hf_config.activation_function],
        "scale_attn_weights": hf_config.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx": hf_config.scale_attn_by_inverse_layer_idx,
        "tie_word_embeddings": ties_word_embeddings(hf_config),
    }


HEAD_ROW_MULTIPLE = 256
"""Off the CPU the LM head's rows are padded to this multiple: a whole tile of MAX's
sm90 GEMM (256 columns), so every output row is 16-byte aligned and no tile has a tail."""


def serves_fast_layers(on_cpu: bool) -> bool:
    """Whether the package's fast layers serve (`layers.layers_for`): on the CPU, unless
    `GPT2_MAX_LAYERS=plain`; MAX's plain layers everywhere else."""
    return on_cpu and settings().layers == "fast"


@dataclass(kw_only=True)
class GPT2ArchConfig(ArchConfigWithStoredKVParams, ArchConfigWithKVCache):
    """Everything the GPT-2 graph is built from (MAX's arch config, not transformers')."""

    DEFAULT_ENCODING: ClassVar[SupportedEncoding] = "float32"
    SUPPORTED_ENCODINGS: ClassVar[set[SupportedEncoding]] = set(encodings.SUPPORTED_ENCODINGS)
    """What each is: `encodings.ENCODINGS`. MAX casts a float32 default to bfloat16
    on any device that is not the CPU, and moves a block encoding asked for on a
    GPU to the CPU, with a warning."""

    vocab_size: int
    usable_vocab_size: int
    """Logits past this id (embedding rows the tokenizer lacks) are masked."""
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    feed_forward_size: int
    max_positions: int
    layer_norm_epsilon: float
    activation: str
    scale_attn_weights: bool
    scale_attn_by_inverse_layer_idx: bool
    tie_word_embeddings: bool
    max_seq_len: int
    dtype: DType
    devices: list[DeviceRef]
    kv_params: KVCacheParams
    return_logits: ReturnLogits = ReturnLogits.LAST_TOKEN
    weights: WeightPlan = field(default_factory=WeightPlan)
    """How the loaded weights are held (packed, float16); the layers follow it."""

    @property
    def fast_layers(self) -> bool:
        """Whether the package's fast layers serve this config (`serves_fast_layers`)."""
        return serves_fast_layers(self.devices[0].is_cpu())

    @property
    def head_rows(self) -> int:
        """Rows of the LM head as the graph multiplies it: the vocabulary, padded with
        zero rows to a multiple of `HEAD_ROW_MULTIPLE` off the CPU (the logits are cut
        back to `vocab_size`). MAX 26.7's bfloat16 GEMM on NVIDIA sm90 writes the tail
        tile of a row whose length is not a multiple of 8 into the next row's first
        columns and past the output's end: at GPT-2's 50257, wrong logits for low
        token ids wherever the head multiplies several rows (`docs/max-26.7.md`)."""
        if self.devices[0].is_cpu():
            return self.vocab_size
        return math.ceil(self.vocab_size / HEAD_ROW_MULTIPLE) * HEAD_ROW_MULTIPLE

    @property
    def head_weight(self) -> str:
        """The state-dict tensor the LM head multiplies (`wte.weight` when tied)."""
        return "wte.weight" if self.head_reads_wte else HEAD_WEIGHT

    @property
    def head_reads_wte(self) -> bool:
        """Whether the LM head multiplies by `wte` in place: a tied head does, unless
        the checkpoint gave it the token table packed as `lm_head.weight` (a
        quantized GGUF), which it then multiplies as blocks, as a layer of its own."""
        return self.tie_word_embeddings and self.weights.encoding(HEAD_WEIGHT) is None

    def attention_scale(self, layer_idx: int) -> float:
        """The softmax scale of layer `layer_idx`, as transformers' GPT-2 applies it."""
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale_attn_weights else 1.0
        if self.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        return scale

    @staticmethod
    def get_num_layers(huggingface_config: AutoConfig) -> int:
        return int(huggingface_config.n_layer)

    @classmethod
    def construct_kv_params(
        cls,
        huggingface_config: AutoConfig,
        pipeline_config: PipelineConfig,
        devices: list[DeviceRef],
        kv_cache_config: KVCacheConfig,
        cache_dtype: DType,
        *,
        allow_kv_head_replication: bool = False,
    ) -> KVCacheParams:
        """Multi-head attention: every query head has its own K/V head."""
        validate_huggingface_config(huggingface_config)
        return kv_cache_config.to_params(
            dtype=cache_dtype,
            allow_kv_head_replication=allow_kv_head_replication,
            n_kv_heads=huggingface_config.n_head,
            head_dim=huggingface_config.n_embd // huggingface_config.n_head,
            num_layers=huggingface_config.n_layer,
            devices=devices,
            data_parallel_degree=pipeline_config.model.data_parallel_degree,
        )

    @override
    @classmethod
    def initialize(
        cls,
        pipeline_config: PipelineConfig,
        model_config: MAXModelConfig | None = None,
        *,
        max_seq_len: int,
    ) -> Self:
        model_config = model_config or pipeline_config.model
        # MAX itself refuses a checkpoint without config.json, naming the folder.
        hf = model_config.huggingface_config
        validate_huggingface_config(hf)
        paths = model_config.resolved_weight_paths()
        check_complete(paths)
        encoding = quantization_encoding(model_config, cls.DEFAULT_ENCODING)
        devices = [
            DeviceRef(spec.device_type, spec.id) for spec in model_config.device_specs
        ]
        return cls(
            # A file's own head (llama.cpp's `output.weight`) unties a tied config.
            **{**shape_fields(hf), "tie_word_embeddings": head_is_table(paths, hf)},
            usable_vocab_size=usable_vocab_size(
                hf.vocab_size,
                tokenizer_vocab_size(
                    model_config.model_path,
                    model_config.huggingface_model_revision,
                    model_config.trust_remote_code,
                ),
            ),
            max_seq_len=max_seq_len,
            # Activations and unpacked weights are float32 under every block
            # encoding (its own dtype, uint8, is its packing).
            dtype=(
                DType.float32
                if encoding in encodings.BLOCK_FLAGS
                else supported_encoding_dtype(encoding)
            ),
            devices=devices,
            kv_params=cls.construct_kv_params(
                huggingface_config=hf,
                pipeline_config=pipeline_config,
                devices=devices,
                kv_cache_config=model_config.kv_cache,
                cache_dtype=cache_dtype_for_encoding(
                    encoding, model_config.kv_cache.kv_cache_format
                ),
            ),
        )
