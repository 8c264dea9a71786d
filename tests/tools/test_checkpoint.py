"""The offline checkpoint writer produces what transformers reads as GPT-2."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from gpt2_max.model_config import GPT2_VOCAB_SIZE
from gpt2_max.testing.reference import TINY
from gpt2_max.tools.checkpoint import (
    PRESETS,
    main,
    preset_config,
    random_hub_state_dict,
    write_checkpoint,
)

pytestmark = pytest.mark.tier("unit")


def test_written_checkpoint_loads_in_transformers_with_every_weight(tmp_path):
    config = GPT2Config(**TINY, tie_word_embeddings=False)
    write_checkpoint(tmp_path, config, seed=3)
    model, info = GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
    written = random_hub_state_dict(config, seed=3)
    params = model.state_dict()
    for name, array in written.items():
        if not name.endswith("attn.bias"):
            key = name if name == "lm_head.weight" else f"transformer.{name}"
            np.testing.assert_array_equal(params[key].numpy(), array, err_msg=name)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_written_checkpoint_carries_the_real_gpt2_tokenizer(tmp_path):
    write_checkpoint(tmp_path, GPT2Config(**TINY))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("Hello world")["input_ids"] == [15496, 995]
    assert tokenizer.eos_token_id == 50256
    assert len(tokenizer) == GPT2_VOCAB_SIZE


def test_presets_have_the_family_shapes():
    assert PRESETS["gpt2-xl"] == dict(n_layer=48, n_embd=1600, n_head=25)
    config = preset_config("gpt2-medium")
    assert (config.n_layer, config.n_embd, config.n_head) == (24, 1024, 16)
    assert (config.vocab_size, config.n_positions) == (GPT2_VOCAB_SIZE, 1024)


def test_command_line_writes_a_preset(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(PRESETS, "distilgpt2", dict(n_layer=1, n_embd=32, n_head=2))
    main([str(tmp_path / "ck"), "--preset", "distilgpt2", "--seed", "1"])
    assert GPT2Config.from_pretrained(tmp_path / "ck").n_layer == 1
    assert "distilgpt2" in capsys.readouterr().out
