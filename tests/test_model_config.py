"""Which GPT-2 configs are accepted, and what the attention scale is."""

from __future__ import annotations

import math
import re

import pytest
from max.dtype import DType
from transformers import GPT2Config

from gpt2_max.model_config import (
    ACTIVATIONS,
    GPT2ArchConfig,
    UnsupportedCheckpointError,
    validate_huggingface_config,
)
from gpt2_max.testing.reference import TINY


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
        max_seq_len=256, dtype=DType.float32, devices=[], kv_params=None,
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
