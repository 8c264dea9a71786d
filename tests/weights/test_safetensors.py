"""Checkpoint layouts, the Conv1D transpose, and broken checkpoints.

Checkpoints are read back through MAX's own safetensors loader, exactly as
`max serve` reads them, and compared with what transformers reads from them.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from max.graph.weights import load_weights
from safetensors.numpy import load_file, save_file
from transformers import GPT2Config

from gpt2_max.testing.reference import (
    TINY,
    load_reference,
    save_transformers_layout,
    write_tiny_checkpoint,
)
from gpt2_max.weights.safetensors import convert_safetensor_state_dict
from gpt2_max.weights.schema import CheckpointError

pytestmark = pytest.mark.tier("unit")

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def convert(folder: Path, config: GPT2Config) -> dict[str, np.ndarray]:
    weights = load_weights(sorted(folder.glob("*.safetensors")))
    converted = convert_safetensor_state_dict(dict(weights.items()), config)
    return {name: np.from_dlpack(w.to_buffer()) for name, w in converted.items()}


def expected_from_hf(model) -> dict[str, np.ndarray]:
    """The HF parameters under our names, Conv1D weights transposed to [out, in]."""
    expected = {}
    for key, value in model.state_dict().items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        array = value.numpy()
        expected[name] = array.T if name.endswith(CONV1D) else array
    return expected


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("layout", ["hub", "transformers", "transformers-sharded"])
def test_layouts_convert_to_the_same_parameters(tmp_path, layout, tied):
    overrides = dict(tie_word_embeddings=tied, n_inner=80)
    folder = write_tiny_checkpoint(tmp_path / "hub", **overrides)
    model = load_reference(folder)
    if layout != "hub":
        sharded = layout.endswith("sharded")
        folder = save_transformers_layout(model, tmp_path / layout, shard=sharded)
        assert (len(list(folder.glob("*.safetensors"))) > 1) == sharded
    converted = convert(folder, GPT2Config(**TINY, **overrides))
    expected = expected_from_hf(model)
    assert sorted(converted) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(converted[name], array, err_msg=name)
        assert converted[name].flags.c_contiguous


def rewrite(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


@pytest.fixture
def hub_checkpoint(tmp_path) -> tuple[Path, GPT2Config]:
    return write_tiny_checkpoint(tmp_path), GPT2Config(**TINY)


def test_tied_head_saved_anyway_is_dropped(hub_checkpoint):
    folder, config = hub_checkpoint
    rewrite(folder, lambda s: s.__setitem__("lm_head.weight", s["wte.weight"].copy()))
    assert "lm_head.weight" not in convert(folder, config)


def test_half_precision_checkpoint_loads_as_float32(hub_checkpoint):
    folder, config = hub_checkpoint
    original = load_file(str(folder / "model.safetensors"))
    rewrite(folder, lambda s: s.update({k: v.astype(np.float16) for k, v in s.items()}))
    converted = convert(folder, config)
    assert converted["wte.weight"].dtype == np.float32
    np.testing.assert_allclose(
        converted["h.0.mlp.c_fc.weight"], original["h.0.mlp.c_fc.weight"].T, atol=2e-3
    )


def put(name: str, array: np.ndarray):
    return lambda state: state.__setitem__(name, array)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda state: state.pop("h.1.mlp.c_proj.bias"),
            "missing 1 tensor(s), first 'h.1.mlp.c_proj.bias' with shape (64,)",
        ),
        (
            put("h.0.attn.c_attn.weight", np.zeros((64, 64), np.float32)),
            "'h.0.attn.c_attn.weight' has shape (64, 64); the config implies (64, 192)",
        ),
        (
            put("h.0.attn.c_attn.weight", np.zeros((192, 64), np.float32)),
            "'h.0.attn.c_attn.weight' has shape (192, 64); the config implies (64, 192)",
        ),
        (
            put("ln_f.weight", np.ones(64, np.int32)),
            "'ln_f.weight' has dtype int32",
        ),
        (
            put("h.9.ln_1.weight", np.ones(64, np.float32)),
            "holds tensors of block 9 ('h.9.ln_1.weight'); the config's n_layer is 2",
        ),
        (
            put("h.0.ln_3.weight", np.ones(64, np.float32)),
            "unexpected tensor 'h.0.ln_3.weight': not a GPT2LMHeadModel parameter",
        ),
    ],
    ids=["missing", "wrong-shape", "not-transposed", "wrong-dtype", "a-block-past-n-layer",
         "unexpected"],
)
def test_broken_checkpoints_name_the_tensor(hub_checkpoint, edit, message):
    folder, config = hub_checkpoint
    rewrite(folder, edit)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        convert(folder, config)
