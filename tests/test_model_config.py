"""Which GPT-2 configs are accepted, and what the attention scale is."""

from __future__ import annotations

import math
import re

import pytest
from max.dtype import DType
from max.graph import DeviceRef
from max.graph.weights import WeightsFormat
from max.pipelines.lib import MAXModelConfig
from max.pipelines.lib.config.model_config import _resolve_weights_and_encoding
from max.pipelines.lib.device_specs import DeviceSpec
from transformers import GPT2Config

from gpt2_max.gpt2 import layer_norm
from gpt2_max.model_config import (
    ACTIVATIONS,
    GPT2ArchConfig,
    UnsupportedCheckpointError,
    validate_huggingface_config,
)
from gpt2_max.testing.reference import TINY

pytestmark = pytest.mark.tier("unit")


def test_family_defaults_are_accepted():
    validate_huggingface_config(GPT2Config())


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_every_listed_activation_is_accepted(name):
    validate_huggingface_config(GPT2Config(**TINY, activation_function=name))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(add_cross_attention=True), "add_cross_attention"),
        (dict(activation_function="gelu_10"), "activation_function 'gelu_10'"),
        (dict(n_embd=65), "n_embd (65) must be divisible by n_head (4)"),
        (dict(n_layer=0), "n_layer must be a positive integer"),
        (dict(n_inner=-1), "n_inner"),
        # MAX's layer norm refuses them as the graph is built, naming no field.
        (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon must be a positive number, got 0.0"),
        (dict(layer_norm_epsilon=-1e-5), "got -1e-05"),
        (dict(layer_norm_epsilon=float("nan")), "got nan"),
        (dict(layer_norm_epsilon=float("inf")), "got inf"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(overrides, message):
    with pytest.raises(UnsupportedCheckpointError, match=re.escape(message)):
        validate_huggingface_config(GPT2Config(**{**TINY, **overrides}))


def test_other_model_types_are_refused():
    config = GPT2Config(**TINY)
    config.model_type = "llama"
    with pytest.raises(UnsupportedCheckpointError, match="model_type 'llama'"):
        validate_huggingface_config(config)


def max_config(**flags: bool) -> GPT2ArchConfig:
    fields = dict(
        vocab_size=1, usable_vocab_size=1, hidden_size=64, num_layers=4, num_heads=4, head_dim=16,
        feed_forward_size=256, max_positions=256, layer_norm_epsilon=1e-5,
        activation="relu", scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False, tie_word_embeddings=True,
        max_seq_len=256, dtype=DType.float32, devices=[DeviceRef.CPU()], kv_params=None,
    )
    return GPT2ArchConfig(**{**fields, **flags})


def test_attention_scale_follows_transformers_flags():
    assert max_config().attention_scale(3) == pytest.approx(1 / math.sqrt(16))
    assert max_config(scale_attn_weights=False).attention_scale(3) == 1.0
    by_layer = max_config(scale_attn_by_inverse_layer_idx=True)
    assert by_layer.attention_scale(3) == pytest.approx(1 / math.sqrt(16) / 4)
    both = max_config(scale_attn_weights=False, scale_attn_by_inverse_layer_idx=True)
    assert both.attention_scale(0) == 1.0
    assert both.attention_scale(1) == 0.5


def gpu_model_config(checkpoint, **settings) -> MAXModelConfig:
    return MAXModelConfig(
        model_path=str(checkpoint), device_specs=[DeviceSpec.accelerator(0)], **settings
    )


def resolve(model_config: MAXModelConfig) -> tuple:
    """MAX's resolution of encoding, cast, weights and devices for this architecture."""
    return _resolve_weights_and_encoding(
        model_config,
        default_encoding=GPT2ArchConfig.DEFAULT_ENCODING,
        supported_encodings=GPT2ArchConfig.SUPPORTED_ENCODINGS,
        default_weights_format=WeightsFormat.safetensors,
    )


def test_a_gpu_resolves_to_bfloat16_which_the_architecture_takes(gpt2_max_checkpoint):
    """What failed `max serve` on a GPU: MAX casts the float32 default to bfloat16
    there and refused an architecture that did not list it."""
    encoding, cast, _, devices = resolve(gpu_model_config(gpt2_max_checkpoint))
    assert (encoding, cast) == ("bfloat16", ("float32", "bfloat16"))
    assert [d.device_type for d in devices] == ["gpu"]
    asked = gpu_model_config(gpt2_max_checkpoint, quantization_encoding="float32")
    assert resolve(asked)[0] == "float32"


def test_bfloat16_on_the_cpu_is_refused_by_max_naming_the_device(gpt2_max_checkpoint):
    model_config = MAXModelConfig(
        model_path=str(gpt2_max_checkpoint), device_specs=[DeviceSpec.cpu()],
        quantization_encoding="bfloat16",
    )
    with pytest.raises(ValueError, match="'bfloat16' is not supported on this device"):
        resolve(model_config)


def test_layer_norms_reduce_in_float32_in_a_bfloat16_graph():
    assert not layer_norm(max_config(dtype=DType.bfloat16)).keep_dtype
    assert layer_norm(max_config()).keep_dtype  # float32: the plain LayerNorm
