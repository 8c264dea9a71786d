"""The GGUF writer: llama.cpp's GPT-2 names, layout, types and metadata.

Quantized tensors are read back with the `gguf` package's own dequantization,
so a byte-layout mistake in our K-quant writers shows up as a large error.
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from transformers import GPT2Config

from gpt2_max.gguf.names import gguf_name
from gpt2_max.gguf.quants import quantize
from gpt2_max.tools.checkpoint import (
    PRESETS,
    TOKENIZER_DIR,
    convert_to_gguf,
    main,
    random_hub_state_dict,
    write_checkpoint,
)
from gpt2_max.tools.gguf_writer import write_gguf

pytestmark = pytest.mark.tier("unit")

# K formats need rows of a multiple of 256 values.
MASK = re.compile(r"h\.\d+\.attn\.bias")
"""The hub's causal-mask buffers, which GGUF files leave out."""

CONFIG = dict(n_layer=8, n_embd=256, n_head=4, n_positions=64)


@pytest.mark.parametrize(
    ("qtype", "max_rms"),
    # Relative RMS error of Gaussian rows: ~2x less per extra bit.
    [(Q.Q4_K, 0.1), (Q.Q5_K, 0.05), (Q.Q6_K, 0.025), (Q.Q4_0, 0.1), (Q.Q8_0, 0.008)],
)
def test_quantized_blocks_read_back_with_gguf(qtype, max_rms):
    rows = np.random.default_rng(0).normal(0, 0.02, size=(8, 512)).astype(np.float32)
    rows[1, :256] = 0.0  # an all-zero block must not divide by zero
    packed = quantize(rows, qtype)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    assert packed.shape == (8, 512 // block * block_bytes)
    back = gguf.quants.dequantize(packed, qtype)
    assert np.all(back[1, :256] == 0.0)
    rms = np.sqrt(np.mean((back - rows) ** 2)) / rows.std()
    assert rms < max_rms


def read(path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("file_type", ["f32", "f16", "q4_k_m"])
def test_gguf_has_llama_cpp_names_layout_and_types(tmp_path, file_type):
    config = GPT2Config(**CONFIG, tie_word_embeddings=False, n_inner=512)
    state = random_hub_state_dict(config, seed=1)
    write_checkpoint(tmp_path / "st", config, seed=1)
    path = convert_to_gguf(tmp_path / "st", tmp_path / "m.gguf", file_type)
    fields, tensors = read(path)

    assert fields["general.architecture"] == "gpt2"
    assert fields["gpt2.block_count"] == 8
    assert fields["gpt2.embedding_length"] == 256
    assert fields["gpt2.feed_forward_length"] == 512
    assert fields["gpt2.context_length"] == 64
    assert fields["gpt2.attention.head_count"] == 4
    assert fields["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.eos_token_id"] == 50256
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == 50257 and tokens[15496] == "Hello" and tokens[50256] == "<|endoftext|>"
    assert fields["tokenizer.ggml.token_type"][50256] == gguf.TokenType.CONTROL
    assert fields["tokenizer.ggml.merges"][0] == "Ġ t"

    expected = {gguf_name(k) for k in state if not MASK.fullmatch(k)}
    assert set(tensors) == expected
    for hub_name, array in state.items():
        if MASK.fullmatch(hub_name):
            continue
        tensor = tensors[gguf_name(hub_name)]
        conv1d = array.ndim == 2 and hub_name.startswith("h.")
        want = array.T if conv1d else array
        # GGUF shapes are ggml's `ne`, innermost first.
        assert list(tensor.shape) == list(want.shape[::-1]), hub_name
        got = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if array.ndim == 1 or (hub_name == "wpe.weight" and file_type != "f16"):
            assert tensor.tensor_type == Q.F32
        scale = np.abs(want).max()
        tolerance = {"f32": 0, "f16": 1e-3, "q4_k_m": 0.2}[file_type]
        np.testing.assert_allclose(got, want, atol=tolerance * scale, err_msg=hub_name)

    if file_type == "q4_k_m":
        types = {name: t.tensor_type for name, t in tensors.items()}
        assert types["output.weight"] == Q.Q6_K
        assert types["token_embd.weight"] == Q.Q4_K
        assert types["blk.3.attn_qkv.weight"] == Q.Q5_K
        assert types["blk.0.ffn_down.weight"] == Q.Q6_K  # llama.cpp's "more bits" layers
        assert types["blk.2.ffn_down.weight"] == Q.Q4_K
        assert types["blk.3.ffn_up.weight"] == Q.Q4_K


def test_k_types_fall_back_like_llama_cpp_when_rows_are_not_256_wide(tmp_path):
    config = GPT2Config(n_layer=1, n_embd=64, n_head=2, n_positions=8)
    path = tmp_path / "m.gguf"
    write_gguf(path, config, random_hub_state_dict(config), "q6_k", TOKENIZER_DIR)
    _, tensors = read(path)
    assert tensors["blk.0.ffn_up.weight"].tensor_type == Q.Q8_0


def test_command_line_writes_a_gguf(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(PRESETS, "distilgpt2", dict(n_layer=1, n_embd=256, n_head=2))
    main([str(tmp_path), "--preset", "distilgpt2", "--format", "gguf", "--type", "q4_k"])
    fields, tensors = read(tmp_path / "gpt2-q4_k.gguf")
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_S
    assert tensors["blk.0.ffn_up.weight"].tensor_type == Q.Q4_K
    assert "q4_k" in capsys.readouterr().out
