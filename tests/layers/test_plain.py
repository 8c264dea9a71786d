"""The core on its own: GPT-2 built from MAX's plain layers, no fast path, is exact.

`layers.Layers` is what a copier of this package starts from, and what runs on a
GPU; here `GPT2_MAX_LAYERS=plain` serves the default checkpoint through it on the
CPU, and it must match transformers as the fast layers do. Its weight cast (the
GPU's bfloat16 among others) is checked against torch's, without a graph.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from max.dtype import DType
from max.graph import DeviceRef, Shape
from max.graph.quantization import QuantizationEncoding
from max.graph.weights import WeightData
from max.pipelines import AutoModel

from gpt2_max.layers import LAYERS_ENV, Layers, layers_for
from gpt2_max.model_config import HEAD_ROW_MULTIPLE, GPT2ArchConfig
from gpt2_max.settings import settings
from gpt2_max.testing.reference import hf_greedy, random_prompt
from gpt2_max.weights.schema import CheckpointError
from tests.test_model_config import max_config

pytestmark = pytest.mark.tier("model")

NEW_TOKENS = 8


@pytest.fixture
def plain_model(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv(LAYERS_ENV, "plain")
    folder = shutil.copytree(checkpoints("default", "hub"), tmp_path / "checkpoint")
    model = AutoModel(
        str(folder), max_batch_size=2, devices="cpu", custom_architectures=["gpt2_max"]
    )
    yield model
    model.close()


def test_plain_layers_match_transformers(plain_model, hf_models):
    assert_matches_transformers(plain_model, hf_models)


def test_a_padded_head_gives_the_same_logits(checkpoints, tmp_path, monkeypatch, hf_models):
    """The GPU's padded LM head (`head_rows`), forced on the CPU: the padding's zero
    rows and the cut back to the vocabulary leave every logit as transformers' are."""
    padded = property(lambda config: config.vocab_size + HEAD_ROW_MULTIPLE - 1)
    monkeypatch.setattr(GPT2ArchConfig, "head_rows", padded)
    monkeypatch.setenv(LAYERS_ENV, "plain")
    folder = shutil.copytree(checkpoints("default", "hub"), tmp_path / "checkpoint")
    model = AutoModel(
        str(folder), max_batch_size=2, devices="cpu", custom_architectures=["gpt2_max"],
        enable_echo=True,  # every row's logits pass the cut, not only the last
    )
    try:
        assert_matches_transformers(model, hf_models)
    finally:
        model.close()


def assert_matches_transformers(model, hf_models):
    prompts = [random_prompt(5, seed=7001), random_prompt(33, seed=7002)]
    result = model.generate(
        prompts, max_new_tokens=NEW_TOKENS, top_k=1, ignore_eos=True, output_logits=True
    )
    for prompt, sequence, logits in zip(prompts, result.sequences, result.logits, strict=True):
        hf_tokens, hf_logits = hf_greedy(hf_models("default"), prompt, NEW_TOKENS)
        assert sequence[len(prompt):] == hf_tokens
        np.testing.assert_allclose(logits, hf_logits, atol=1e-4, rtol=0)


@pytest.mark.tier("unit")
def test_the_setting_picks_plain_layers_on_the_cpu(monkeypatch):
    cpu = max_config(devices=[DeviceRef.CPU()])
    assert type(layers_for(cpu)).__name__ == "FastLayers"
    monkeypatch.setenv(LAYERS_ENV, "plain")
    settings.cache_clear()
    assert type(layers_for(cpu)) is Layers


@pytest.mark.tier("unit")
def test_a_gpu_always_gets_the_plain_layers():
    assert type(layers_for(max_config(devices=[DeviceRef.GPU()]))) is Layers


def as_torch(weight: WeightData) -> torch.Tensor:
    return torch.from_dlpack(weight.data)


@pytest.mark.tier("unit")
@pytest.mark.parametrize("graph", [DType.bfloat16, DType.float32])
def test_prepare_casts_each_float_tensor_from_its_own_dtype(graph):
    rng = np.random.default_rng(0)
    source = torch.from_numpy(rng.standard_normal((8, 24)).astype(np.float32) * 7)
    tensors = {
        "f32": source,
        "f16": source.to(torch.float16),
        "bf16": source.to(torch.bfloat16),
    }
    state = {
        name: (
            WeightData.from_numpy(t.numpy(), name) if t.dtype != torch.bfloat16
            else WeightData.from_numpy(t.float().numpy(), name).astype(DType.bfloat16)
        )
        for name, t in tensors.items()
    }
    prepared = Layers(max_config(dtype=graph)).prepare(state)
    target = torch.bfloat16 if graph == DType.bfloat16 else torch.float32
    for name, tensor in tensors.items():
        assert prepared[name].dtype == graph
        assert torch.equal(as_torch(prepared[name]), tensor.to(target)), name


@pytest.mark.tier("unit")
@pytest.mark.parametrize("tied", [True, False])
def test_prepare_pads_the_head_with_zero_rows_off_the_cpu(tied):
    rng = np.random.default_rng(1)
    head = "wte.weight" if tied else "lm_head.weight"
    table = rng.standard_normal((300, 8)).astype(np.float32)
    state = {head: WeightData.from_numpy(table, head)}
    settings = dict(vocab_size=300, tie_word_embeddings=tied, dtype=DType.bfloat16)
    gpu = max_config(devices=[DeviceRef.GPU()], **settings)
    assert gpu.head_rows == 512 and gpu.head_weight == head
    prepared = as_torch(Layers(gpu).prepare(state)[head]).float()
    assert prepared.shape == (512, 8)
    assert torch.equal(prepared[:300], torch.from_numpy(table).to(torch.bfloat16).float())
    assert not prepared[300:].any()
    cpu = max_config(**settings)
    assert cpu.head_rows == 300
    assert tuple(Layers(cpu).prepare(state)[head].shape) == (300, 8)


@pytest.mark.tier("unit")
def test_prepare_refuses_packed_blocks_naming_the_tensor():
    blocks = np.zeros((4, 144), dtype=np.uint8)
    packed = WeightData(
        blocks, "h.0.mlp.c_fc.weight", DType.uint8, Shape(blocks.shape),
        quantization_encoding=QuantizationEncoding.Q4_K,
    )
    with pytest.raises(CheckpointError, match=r"'h\.0\.mlp\.c_fc\.weight' is packed as q4_k"):
        Layers(max_config()).prepare({"h.0.mlp.c_fc.weight": packed})
