"""Which GPT-2 may draft for a model: read from a folder or a GGUF file, refused by
name where its tokens or positions are not the model's; its cache, as many pages as
the model's in its own shape, or none where that does not fit."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import psutil
import pytest
import torch
from max.driver import CPU, Buffer
from max.dtype import DType
from transformers import GPT2Config

from gpt2_max.extensions import Beside, memory_beside
from gpt2_max.settings import setting, settings
from gpt2_max.speculate.draft import (
    ENV,
    Draft,
    check_fits,
    checkpoint_config,
    checkpoint_files,
    memory,
)
from gpt2_max.testing.reference import (
    TINY,
    load_reference,
    save_gguf,
    saved_in,
    write_tiny_checkpoint,
)
from gpt2_max.weights.schema import parameter_count

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


def first_step(pages: int) -> SimpleNamespace:
    """What `Draft.allocate` reads of a step's inputs: the model's cache and device."""
    blocks = Buffer(shape=(pages, 2, 2, 16, 4, 16), dtype=DType.float32)
    return SimpleNamespace(kv_cache_inputs=[SimpleNamespace(kv_blocks=blocks)],
                           tokens=SimpleNamespace(device=CPU()))


def unbuilt_draft(layers: int) -> Draft:
    """A `Draft`'s cache bookkeeping without its compile: `layers` of 4 heads of 16."""
    draft = Draft.__new__(Draft)
    draft.kv_params = SimpleNamespace(shape_per_block=[2, layers, 16, 4, 16], dtype=DType.float32)
    draft._share = 0.9
    draft._blocks = None
    return draft


def test_the_draft_takes_as_many_pages_as_the_model_in_its_own_shape(monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2**30))
    draft = unbuilt_draft(layers=1)
    assert draft.allocate(first_step(pages=9)) is None
    assert tuple(draft._blocks.shape) == (9, 2, 1, 16, 4, 16)
    assert draft.allocate(first_step(pages=9)) is None  # once


def test_a_draft_cache_that_does_not_fit_beside_the_models_is_refused(monkeypatch):
    # 64 pages of 16 KiB each for the model and for the draft: 2 MiB, in 2 MiB left.
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2**21))
    draft = unbuilt_draft(layers=2)
    refused = draft.allocate(first_step(pages=64))
    assert refused is not None and "--max-batch-total-tokens" in refused
    assert draft._blocks is None


PAGE = SimpleNamespace(bytes_per_block=4096)
"""The model's cache pages, as `memory` reads them."""


@pytest.mark.parametrize("inner", [None, 96])
def test_a_self_draft_takes_its_packed_matrices_its_tables_and_a_page_a_page(tmp_path, inner):
    hf = load_reference(write_tiny_checkpoint(tmp_path / "hub", n_inner=inner))
    packed = floats = 0
    for name, tensor in hf.state_dict().items():
        if name.endswith(".weight") and ".h." in name and tensor.ndim == 2:
            packed += gguf.quants.quantize(tensor.numpy().T, gguf.GGMLQuantizationType.Q8_0).nbytes
        elif name in ("transformer.wte.weight", "transformer.wpe.weight"):
            floats += tensor.numel() * 4
    wte = hf.state_dict()["transformer.wte.weight"].numpy().astype(np.float32)
    packed += gguf.quants.quantize(wte, gguf.GGMLQuantizationType.Q8_0).nbytes  # the tied head
    beside = memory("q8_0", hf.config, PAGE)
    assert beside.fixed == pytest.approx(packed + floats, rel=1e-3)
    assert beside.per_page == PAGE.bytes_per_block


def test_a_smaller_gpt2_takes_its_files_and_a_page_of_its_own_shape_a_page(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "hub", n_layer=1)
    beside = memory(str(folder), GPT2Config(**TINY), PAGE)
    assert beside.fixed == sum(f.stat().st_size for f in checkpoint_files(folder))
    assert beside.per_page == PAGE.bytes_per_block // TINY["n_layer"]


def test_a_smaller_gpt2_saved_in_half_precision_takes_its_float32_values(tmp_path):
    """The safetensors adapter widens its tensors: twice the files' bytes."""
    folder = saved_in(write_tiny_checkpoint(tmp_path / "hub", n_layer=1), torch.float16)
    beside = memory(str(folder), GPT2Config(**TINY), PAGE)
    config = GPT2Config(**{**TINY, "n_layer": 1})
    assert beside.fixed == parameter_count(config) * 4
    assert beside.fixed > sum(f.stat().st_size for f in checkpoint_files(folder))


@pytest.fixture
def draft_setting(monkeypatch):
    """Sets `GPT2_MAX_DRAFT` (None: unsets it) for this test's reading of the settings."""

    def choose(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, value)
        settings.cache_clear()

    yield choose
    settings.cache_clear()  # read again, from the environment monkeypatch restores


def pipeline(device: str) -> SimpleNamespace:
    """What the room's `memory` reads of a pipeline config."""
    spec = SimpleNamespace(device_type=device)
    return SimpleNamespace(model=SimpleNamespace(device_specs=[spec]))


def test_the_planner_leaves_the_room_its_draft_on_the_cpu_alone(draft_setting):
    config = GPT2Config(**TINY)
    draft_setting("q8_0")
    assert memory_beside(pipeline("cpu"), config, PAGE) == memory("q8_0", config, PAGE)
    assert memory_beside(pipeline("gpu"), config, PAGE) == Beside()


def test_the_plain_layers_leave_no_room_for_a_draft(draft_setting, monkeypatch):
    """`GPT2_MAX_LAYERS=plain` multiplies no packed draft, so none is built (the
    extension says so at load) and the planner leaves it nothing."""
    monkeypatch.setenv(setting("layers").variable, "plain")
    draft_setting("q8_0")
    assert memory_beside(pipeline("cpu"), GPT2Config(**TINY), PAGE) == Beside()


def test_without_a_draft_the_planner_leaves_nothing_beside_the_cache(draft_setting):
    draft_setting(None)
    assert memory_beside(pipeline("cpu"), GPT2Config(**TINY), PAGE) == Beside()
