"""Which GPT-2 may draft for a model: read from a folder or a GGUF file, refused by
name where its tokens or positions are not the model's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import GPT2Config

from gpt2_max.speculate.draft import ENV, check_fits, checkpoint_config, checkpoint_files
from gpt2_max.testing.reference import TINY, load_reference, save_gguf, write_tiny_checkpoint

pytestmark = pytest.mark.tier("unit")


def model(**config) -> SimpleNamespace:
    """What `check_fits` reads of a pipeline model."""
    return SimpleNamespace(huggingface_config=GPT2Config(**TINY), max_seq_len=1024, **config)


def test_a_smaller_gpt2_of_the_same_vocabulary_fits():
    check_fits(GPT2Config(**{**TINY, "n_layer": 1, "n_embd": 32, "n_head": 2}), model())


def test_a_draft_of_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match=rf"{ENV}: the draft has a vocabulary of 50000 tokens"):
        check_fits(GPT2Config(**{**TINY, "vocab_size": 50000}), model())


def test_a_draft_with_fewer_positions_than_the_model_serves_is_refused():
    with pytest.raises(ValueError, match=r"has 512 positions, fewer than the 1024"):
        check_fits(GPT2Config(**{**TINY, "n_positions": 512}), model())


def test_a_draft_that_is_no_gpt2_is_refused():
    with pytest.raises(ValueError, match=r"n_embd \(64\) must be divisible by n_head \(5\)"):
        check_fits(GPT2Config(**{**TINY, "n_head": 5}), model())


def test_a_gguf_file_gives_its_own_shape(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "hub", n_layer=1)
    path = save_gguf(load_reference(folder), tmp_path / "gguf", "f32")
    assert checkpoint_files(path) == [path]
    config = checkpoint_config(path, [path])
    assert (config.n_layer, config.n_embd, config.vocab_size) == (1, 64, 50257)
    assert [p.suffix for p in checkpoint_files(folder)] == [".safetensors"]
    assert checkpoint_config(folder, checkpoint_files(folder)).n_layer == 1


def test_a_folder_without_weights_is_refused(tmp_path):
    with pytest.raises(ValueError, match=rf"{ENV}=.*: the folder holds no weights"):
        checkpoint_files(tmp_path)
