"""The core on its own: GPT-2 built from MAX's plain layers, no fast path, is exact.

`layers.Layers` is what a copier of this package starts from, and what runs on a
GPU; here `GPT2_MAX_LAYERS=plain` serves the default checkpoint through it on the
CPU, and it must match transformers as the fast layers do, and a quantized GGUF as
transformers on its dequantized weights. Its weight cast (the GPU's bfloat16 among
others) and its dequantization are checked against torch's and the `gguf` package's,
without a graph.
"""

from __future__ import annotations

import logging
import shutil
import weakref

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from max.dtype import DType
from max.graph import DeviceRef
from max.graph.weights import WeightData, load_weights
from max.pipelines import AutoModel
from transformers import GPT2Config

from gpt2_max import layers
from gpt2_max.encodings import PACKED_TYPES
from gpt2_max.gguf.adapter import convert_gguf_state_dict
from gpt2_max.gguf.names import gguf_name
from gpt2_max.gguf.quants import quantize
from gpt2_max.gpt2 import GPT2
from gpt2_max.layers import LAYERS_ENV, Layers, layers_for
from gpt2_max.model_config import HEAD_ROW_MULTIPLE, GPT2ArchConfig
from gpt2_max.names import PACKAGE
from gpt2_max.settings import settings
from gpt2_max.testing.reference import hf_greedy, hf_on_gguf_weights, random_prompt
from gpt2_max.tokenizer import TOKENIZER_DIR
from gpt2_max.tools.checkpoint import random_hub_state_dict
from gpt2_max.tools.gguf_writer import gguf_tensors, write_tensors
from gpt2_max.weights.plan import block_type, unpacked
from gpt2_max.weights.schema import HEAD_WEIGHT
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
    assert_matches(plain_model, hf_models("default"))


def test_the_gpus_graph_gives_the_same_logits(checkpoints, tmp_path, monkeypatch, hf_models):
    """The GPU's graph forced on the CPU: its padded LM head (`head_rows`), whose zero
    rows and cut back to the vocabulary leave every logit as transformers' are, and its
    last rows without drafts (`gpt2.last_rows`), one a sequence."""
    padded = property(lambda config: config.vocab_size + HEAD_ROW_MULTIPLE - 1)
    monkeypatch.setattr(GPT2ArchConfig, "head_rows", padded)
    monkeypatch.setattr(GPT2, "drafts", property(lambda module: False))
    monkeypatch.setenv(LAYERS_ENV, "plain")
    folder = shutil.copytree(checkpoints("default", "hub"), tmp_path / "checkpoint")
    model = AutoModel(
        str(folder), max_batch_size=2, devices="cpu", custom_architectures=["gpt2_max"],
        enable_echo=True,  # every row's logits pass the cut, not only the last
    )
    try:
        assert_matches(model, hf_models("default"))
    finally:
        model.close()


def assert_matches(model, reference):
    """Greedy tokens and every step's logits as transformers' `reference` gives them."""
    prompts = [random_prompt(5, seed=7001), random_prompt(33, seed=7002)]
    result = model.generate(
        prompts, max_new_tokens=NEW_TOKENS, top_k=1, ignore_eos=True, output_logits=True
    )
    for prompt, sequence, logits in zip(prompts, result.sequences, result.logits, strict=True):
        hf_tokens, hf_logits = hf_greedy(reference, prompt, NEW_TOKENS)
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
    state = {name: weight_data(t, name) for name, t in tensors.items()}
    prepared = Layers(max_config(dtype=graph)).prepare(state)
    target = torch.bfloat16 if graph == DType.bfloat16 else torch.float32
    for name, tensor in tensors.items():
        assert prepared[name].dtype == graph
        assert torch.equal(as_torch(prepared[name]), tensor.to(target)), name


@pytest.mark.tier("unit")
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("source", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("graph", [DType.bfloat16, DType.float32])
def test_prepare_pads_the_head_with_zero_rows_off_the_cpu(tied, source, graph):
    """Padded after its cast, in the graph's dtype (bfloat16, which numpy cannot
    hold, on a GPU), whatever dtype the adapter hands it over in."""
    rng = np.random.default_rng(1)
    head = "wte.weight" if tied else "lm_head.weight"
    table = torch.from_numpy(rng.standard_normal((300, 8)).astype(np.float32)).to(source)
    state = {head: weight_data(table, head)}
    settings = dict(vocab_size=300, tie_word_embeddings=tied, dtype=graph)
    gpu = max_config(devices=[DeviceRef.GPU()], **settings)
    assert gpu.head_rows == 512 and gpu.head_weight == head
    prepared = Layers(gpu).prepare(state)[head]
    assert prepared.dtype == graph
    values = as_torch(prepared)
    assert values.shape == (512, 8)
    target = torch.bfloat16 if graph == DType.bfloat16 else torch.float32
    assert torch.equal(values[:300], table.to(target))
    assert not values[300:].any()
    cpu = max_config(**settings)
    assert cpu.head_rows == 300
    assert tuple(Layers(cpu).prepare(state)[head].shape) == (300, 8)


def weight_data(tensor: torch.Tensor, name: str) -> WeightData:
    """`tensor` as a `WeightData`, bfloat16 included."""
    if tensor.dtype != torch.bfloat16:
        return WeightData.from_numpy(tensor.numpy(), name)
    return WeightData.from_numpy(tensor.float().numpy(), name).astype(DType.bfloat16)


SMALL = GPT2Config(n_layer=1, n_embd=256, n_head=4, n_positions=8, vocab_size=512)
"""Rows of 256 and 1024 values, which every block type packs."""


def packed_state(folder, kind: str) -> tuple[dict[str, WeightData], dict[str, tuple]]:
    """The adapter's state dict of a GGUF whose four projections and token table are
    blocks of `kind`, and the file's tensors by llama.cpp name."""
    qtype = Q[kind.upper()]
    tensors = gguf_tensors(SMALL, random_hub_state_dict(SMALL, seed=3), "f32")
    for name, (array, _) in list(tensors.items()):
        if array.ndim == 2 and not name.startswith("position"):
            tensors[name] = (quantize(array, qtype), qtype)
    path = write_tensors(folder / "m.gguf", SMALL, tensors, "f32", TOKENIZER_DIR)
    return convert_gguf_state_dict(dict(load_weights([path]).items()), SMALL), tensors


@pytest.mark.tier("unit")
@pytest.mark.parametrize("graph", [DType.bfloat16, DType.float32])
@pytest.mark.parametrize("kind", sorted(PACKED_TYPES))
def test_prepare_dequantizes_packed_blocks_in_the_graphs_dtype(tmp_path, caplog, kind, graph):
    """What a GPU (or `GPT2_MAX_LAYERS=plain`) does with a quantized GGUF: each block
    type the CPU keeps packed loads as the `gguf` package's floats in the graph's
    dtype, the tied head's packed copy of the table goes, and one line says so."""
    state, tensors = packed_state(tmp_path, kind)
    assert block_type(state["h.0.mlp.c_fc.weight"]) == kind
    assert block_type(state[HEAD_WEIGHT]) == kind  # the tied head's packed table
    config = max_config(
        devices=[DeviceRef.GPU()], dtype=graph, vocab_size=512, usable_vocab_size=512,
        hidden_size=256, num_layers=1, feed_forward_size=1024,
    )
    with caplog.at_level(logging.INFO, logger="max.pipelines"):
        prepared = Layers(config).prepare(state)
    assert HEAD_WEIGHT not in prepared
    target = torch.bfloat16 if graph == DType.bfloat16 else torch.float32
    for name, weight in prepared.items():
        assert weight.dtype == graph and block_type(weight) is None, name
        array, qtype = tensors[gguf_name(name)]
        expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(array, qtype)))
        assert torch.equal(as_torch(weight), expected.to(target)), name
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith(
        f"{PACKAGE}: 4 packed GGUF tensor(s) ({kind}) dequantized to {graph.name} at load"
    )


@pytest.mark.tier("unit")
def test_prepare_holds_one_tensors_float32_at_a_time(tmp_path, monkeypatch):
    """gpt2-xl's packed file as float32 all at once would be 6 GB beside its
    bfloat16: each tensor's float32 is gone before the next is dequantized."""
    state, _ = packed_state(tmp_path, "q8_0")
    alive = []

    def tracked(weight):
        assert not [name for name, held in alive if held() is not None], alive
        result = unpacked(weight)
        alive.append((weight.name, weakref.ref(result.data)))
        return result

    monkeypatch.setattr(layers, "unpacked", tracked)
    config = max_config(
        devices=[DeviceRef.GPU()], dtype=DType.bfloat16, vocab_size=512, usable_vocab_size=512,
        hidden_size=256, num_layers=1, feed_forward_size=1024,
    )
    prepared = Layers(config).prepare(state)
    assert len(alive) == 4 and all(held() is None for _, held in alive)
    assert all(weight.dtype == DType.bfloat16 for weight in prepared.values())


@pytest.mark.tier("unit")
def test_prepare_keeps_an_untied_heads_blocks_as_floats(tmp_path):
    state, tensors = packed_state(tmp_path, "q8_0")
    config = max_config(
        devices=[DeviceRef.GPU()], dtype=DType.bfloat16, vocab_size=512, usable_vocab_size=512,
        hidden_size=256, num_layers=1, feed_forward_size=1024, tie_word_embeddings=False,
    )
    prepared = Layers(config).prepare({HEAD_WEIGHT: state[HEAD_WEIGHT]})  # the table's blocks
    array, qtype = tensors["token_embd.weight"]
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(array, qtype)))
    assert torch.equal(as_torch(prepared[HEAD_WEIGHT]), expected.to(torch.bfloat16))


def test_plain_layers_serve_a_packed_gguf_as_its_dequantized_weights(
    xl_rows_model, gguf_files, monkeypatch, caplog
):
    """End to end, the plain layers on an xl-shaped Q4_K_M mix (projections in Q4_K,
    Q6_K and the Q5_0, Q5_1 fallbacks, the table in Q8_0): exact against transformers
    on the same dequantized weights, as a float checkpoint is."""
    monkeypatch.setenv(LAYERS_ENV, "plain")
    path = gguf_files(xl_rows_model, "q4_k_m")
    with caplog.at_level(logging.INFO, logger="max.pipelines"):
        model = AutoModel(str(path.parent), weight_path=[str(path)], max_batch_size=2,
                          devices="cpu", custom_architectures=["gpt2_max"])
    try:
        said = [r.getMessage() for r in caplog.records if "packed GGUF" in r.getMessage()]
        assert len(said) == 1 and "(q4_k, q5_0, q5_1, q6_k) dequantized" in said[0], said
        assert_matches(model, hf_on_gguf_weights(xl_rows_model, path))
    finally:
        model.close()
