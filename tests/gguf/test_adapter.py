"""GGUF files through MAX against transformers on the same (dequantized) weights.

Float files (F32; F16, served from float16 matrices) must match transformers
on the file's own weights like safetensors do.
Block-quantized files are compared with transformers running the weights the
`gguf` package dequantizes from the same file, so only MAX's kernel arithmetic
differs: `qmatmul` quantizes activations to 8 bits per block. Every comparison
is teacher-forced on MAX's own tokens, so one near-tie does not derail the
rest. Parity figures print with `-s`.
"""

from __future__ import annotations

import copy
import logging
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from max.dtype import DType
from max.graph.quantization import QuantizationEncoding
from max.graph.weights import load_weights
from max.pipelines import AutoModel
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from gpt2_max.gguf.adapter import convert_gguf_state_dict, held_bytes
from gpt2_max.gguf.names import gguf_name
from gpt2_max.gguf.quants import quantize
from gpt2_max.layers import LAYERS_ENV
from gpt2_max.testing.reference import (
    hf_greedy,
    hf_on_gguf_weights,
    random_prompt,
    save_gguf,
)
from gpt2_max.tokenizer import TOKENIZER_DIR
from gpt2_max.tools.checkpoint import random_hub_state_dict
from gpt2_max.tools.gguf_config import write_companion_files
from gpt2_max.tools.gguf_writer import gguf_tensors, write_gguf, write_tensors
from gpt2_max.weights.plan import WeightPlan, block_type
from gpt2_max.weights.schema import CheckpointError

pytestmark = pytest.mark.tier("model")

NEW_TOKENS = 32


def half_precision_names(n_layer: int) -> set[str]:
    """The parameters an F16 file (tied head) keeps in float16: the matmul weights
    and the token table; the position table, norms and biases are float32."""
    parts = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    return {"wte.weight"} | {f"h.{i}.{part}.weight" for i in range(n_layer) for part in parts}


# GGUF cannot carry activation_function, scale_attn_weights,
# scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn: config.json beside
# the file supplies them (MAX reads it first). The variant's untied head,
# n_inner and layer_norm_epsilon come from the GGUF itself.
@pytest.mark.parametrize("file_type", ["f32", "f16"])
@pytest.mark.parametrize("variant", ["default", "relu-untied-padded-unscaled-layer-scaled"])
def test_float_gguf_matches_transformers(variant, file_type, hf_models, gguf_files, max_models):
    path = gguf_files(hf_models(variant), file_type)
    reference = hf_on_gguf_weights(hf_models(variant), path)
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 40, 150)]
    result = max_models(path).generate(
        prompts, max_new_tokens=NEW_TOKENS, top_k=1, ignore_eos=True, output_logits=True
    )
    for prompt, sequence, logits in zip(prompts, result.sequences, result.logits, strict=True):
        hf_tokens, hf_logits = hf_greedy(reference, prompt, NEW_TOKENS)
        assert sequence[len(prompt):] == hf_tokens
        # Ids past the tokenizer (the padded variant) are masked to -inf by MAX.
        vocab = hf_logits.shape[1]
        np.testing.assert_allclose(np.asarray(logits)[:, :vocab], hf_logits, atol=1e-3, rtol=0)


def resident_kib(path: Path) -> int:
    """This process's resident memory in mappings of `path`."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = len(fields) >= 6 and fields[5] == str(path.resolve())
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_f16_gguf_is_served_from_float16_matrices_and_leaves_its_file(
    hf_models, gguf_files, max_models, tmp_path
):
    # A copy of the file no other reader in this process has mapped.
    source = gguf_files(hf_models("default"), "f16")
    path = shutil.copytree(source.parent, tmp_path / "f16") / source.name
    model = max_models(path)
    # The weights the compiled graph is bound to (MAX keeps no public path to them).
    held = model.pipeline._pipeline_model.model.weights
    dtypes = {name: value.dtype for name, value in held.items()}
    half = half_precision_names(hf_models("default").config.n_layer)
    assert {name: dtypes[name] for name in half} == dict.fromkeys(half, DType.float16)
    assert {dtypes[name] for name in dtypes.keys() - half} == {DType.float32}
    # Every tensor was copied out, so none of the file stays resident: MAX keeps
    # it mapped, but `release_pages` gave its pages back.
    assert str(path.resolve()) in Path("/proc/self/maps").read_text()
    assert resident_kib(path) == 0
    prompt = random_prompt(20, seed=77)
    assert model.generate([prompt], max_new_tokens=4, top_k=1, ignore_eos=True).sequences[0][
        len(prompt):
    ] == hf_greedy(hf_on_gguf_weights(hf_models("default"), source), prompt, 4)[0]


def teacher_forced_logits(model: GPT2LMHeadModel, tokens: list[int], start: int) -> np.ndarray:
    """transformers' next-token logits after `tokens[:i]` for i in start..len(tokens)-1."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return logits[start - 1 : len(tokens) - 1].numpy()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# The bounds leave room below what this 2-layer, 256-wide random model (std 0.2
# weights) measures (`docs/gguf.md`'s parity table): the error does not shrink from 4 to
# 6 weight bits, so it is the kernels' 8-bit activations, which the
# dequantized-weight reference does not have. A wrong block layout or scale
# gives about chance agreement (1 in the vocabulary) and errors of the logits'
# own size.
# Each file is a graph to compile: q4_k_m runs its Q4_K, Q5_K and Q6_K blocks
# on the kernels this CPU's choice gives them (`layers/kernel_choice.py`), in the
# graph the served test (`test_serve.py`) uses.
# The xl-rows model's Q4_K_M file holds Q5_0, Q5_1 and Q8_0 projections beside k-quants,
# all multiplied packed (`XL_ROWS`).
BOUNDS = {
    # (model, file type): (min top-1 agreement, max |logit error| / logit std,
    # max mean |Δ log p|)
    ("quantized_model", "q4_0"): (0.80, 1.0, 0.25),
    ("quantized_model", "q4_k_m"): (0.80, 1.0, 0.25),
    ("xl_rows_model", "q4_k_m"): (0.80, 1.0, 0.25),
}


@pytest.mark.parametrize("model_name, file_type", sorted(BOUNDS))
def test_quantized_gguf_matches_transformers_on_dequantized_weights(
    model_name, file_type, request, gguf_files, max_models
):
    source = request.getfixturevalue(model_name)
    path = gguf_files(source, file_type)
    if model_name == "xl_rows_model":
        types = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
        assert {Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K} <= types, types
    reference = hf_on_gguf_weights(source, path)
    model = max_models(path)

    lengths = (1, 3, 7, 12, 20, 33, 50, 64, 90, 128, 200, 300)
    prompts = [random_prompt(n, seed=100 + n) for n in lengths]
    agree, errors, scales = [], [], []
    for batch in range(0, len(prompts), 4):
        chunk = prompts[batch : batch + 4]
        result = model.generate(
            chunk, max_new_tokens=NEW_TOKENS, top_k=1, ignore_eos=True, output_logits=True
        )
        for prompt, sequence, logits in zip(chunk, result.sequences, result.logits, strict=True):
            hf_logits = teacher_forced_logits(reference, sequence, len(prompt))
            agree.append(hf_logits.argmax(axis=-1) == np.asarray(sequence[len(prompt):]))
            errors.append(np.abs(np.asarray(logits, np.float64) - hf_logits).max())
            scales.append(hf_logits.std())
    top1 = float(np.mean(np.concatenate(agree)))
    max_error = float(max(errors))
    relative_error = max_error / float(np.mean(scales))

    # Per-token log-likelihood of a 512-token text MAX samples (temperature 1),
    # scored by both: MAX from its step logits, transformers teacher-forced.
    start = [random_prompt(1, seed=7)[0]]
    result = model.generate([start], max_new_tokens=511, temperature=1.0, seed=3,
                            ignore_eos=True, output_logits=True)
    text = result.sequences[0]
    picked = np.asarray(text[1:])
    ours = log_softmax(np.asarray(result.logits[0]))[np.arange(511), picked]
    theirs = log_softmax(teacher_forced_logits(reference, text, 1))[np.arange(511), picked]
    delta = np.abs(ours - theirs)

    print(
        f"\n{model_name} {file_type}: top-1 {top1:.4f} over {len(np.concatenate(agree))} steps, "
        f"max |logit err| {max_error:.4f} ({relative_error:.4f} of logit std "
        f"{np.mean(scales):.2f}), 512-token text: mean |Δlog p| {delta.mean():.5f}, "
        f"max {delta.max():.4f}, mean log p MAX {ours.mean():.4f} HF {theirs.mean():.4f}"
    )
    min_top1, max_relative, max_delta = BOUNDS[model_name, file_type]
    assert top1 >= min_top1
    assert relative_error <= max_relative
    assert delta.mean() <= max_delta


@pytest.mark.parametrize("layers", ["fast", "plain"])
def test_a_tied_hub_config_serves_llama_cpps_own_head(
    quantized_model, tmp_path, max_models, monkeypatch, layers
):
    """A Q4_K_M file as llama.cpp writes GPT-2 (the tied head again as `output.weight`,
    Q6_K beside a Q4_K table) beside the hub's `config.json`, which ties them, answers
    as beside the config the file implies (`gpt2-max-gguf-config`'s, untied): the same
    logits, bit for bit, on the CPU's fast layers and on the plain ones a GPU serves
    (which dequantize it). Before, the tied config's head was the table's Q4_K blocks."""
    untied = copy.deepcopy(quantized_model)
    untied.lm_head.weight = torch.nn.Parameter(quantized_model.lm_head.weight.detach().clone())
    untied.config.tie_word_embeddings = False
    own = save_gguf(untied, tmp_path / "own", "q4_k_m")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(own).tensors}
    assert (types["output.weight"], types["token_embd.weight"]) == (Q.Q6_K, Q.Q4_K)
    hub = shutil.copytree(own.parent, tmp_path / "hub") / own.name
    quantized_model.config.to_json_file(hub.parent / "config.json")
    prompts = [random_prompt(n, seed=n) for n in (1, 30)]
    answers = []
    for path in (hub, own):
        if layers == "fast":
            model = max_models(path)
        else:
            monkeypatch.setenv(LAYERS_ENV, "plain")
            model = AutoModel(str(path.parent), weight_path=[str(path)], max_batch_size=2,
                              devices="cpu", custom_architectures=["gpt2_max"])
        assert model.pipeline_config.model.huggingface_config.tie_word_embeddings == (
            path == hub)
        answers.append(model.generate(prompts, max_new_tokens=NEW_TOKENS, top_k=1,
                                      ignore_eos=True, output_logits=True))
        if layers == "plain":
            model.close()
    ours, theirs = answers
    assert ours.sequences == theirs.sequences
    for a, b in zip(ours.logits, theirs.logits, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# The adapter alone, on MAX's own GGUF reader: no graph is compiled.

SMALL = GPT2Config(n_layer=1, n_embd=256, n_head=4, n_positions=8, vocab_size=512)


def small_tensors(file_type: str) -> dict[str, tuple[np.ndarray, Q]]:
    return gguf_tensors(SMALL, random_hub_state_dict(SMALL, seed=2), file_type)


def adapt(path: Path, config: GPT2Config = SMALL) -> dict[str, np.ndarray]:
    converted = convert_gguf_state_dict(dict(load_weights([path]).items()), config)
    return converted


@pytest.mark.tier("unit")
def test_types_without_a_kernel_are_dequantized_with_one_log_line(tmp_path, caplog):
    tensors = small_tensors("q4_k")
    state = random_hub_state_dict(SMALL, seed=2)
    up = state["h.0.mlp.c_fc.weight"].T  # [out, in], as GGUF stores it
    tensors["blk.0.ffn_up.weight"] = (quantize(up, Q.Q4_1), Q.Q4_1)
    tensors["blk.0.attn_qkv.weight"] = (
        quantize(state["h.0.attn.c_attn.weight"].T, Q.Q5_K), Q.Q5_K
    )
    path = write_tensors(tmp_path / "m.gguf", SMALL, tensors, "q4_k", TOKENIZER_DIR)
    with caplog.at_level(logging.INFO, logger="max.pipelines"):
        converted = adapt(path)
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1
    assert "blk.0.ffn_up.weight (Q4_1)" in lines[0] and "Q5_K" not in lines[0]
    up_back = np.from_dlpack(converted["h.0.mlp.c_fc.weight"])
    assert up_back.dtype == np.float32 and up_back.shape == up.shape
    np.testing.assert_allclose(up_back, up, atol=0.1 * np.abs(up).max())
    packed = converted["h.0.mlp.c_proj.weight"]
    assert packed.quantization_encoding == QuantizationEncoding.Q4_K
    assert [int(d) for d in packed.shape] == [256, 1024 // 256 * 144]
    qkv = converted["h.0.attn.c_attn.weight"]  # Q5_K: the package's kernel decodes it
    assert qkv.quantization_encoding == QuantizationEncoding.Q5_K
    np.testing.assert_array_equal(
        np.asarray(qkv.data), tensors["blk.0.attn_qkv.weight"][0]
    )
    assert converted["wte.weight"].quantization_encoding is None  # tables load as float32
    assert np.from_dlpack(converted["wte.weight"]).dtype == np.float32


@pytest.mark.tier("unit")
@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.Q8_0])
def test_types_maxs_reader_refuses_stay_packed_as_the_file_stores_them(tmp_path, caplog, qtype):
    """What llama.cpp's k-quant mixes write for rows not a multiple of 256 (gpt2-xl's)."""
    tensors = small_tensors("q4_k")
    up = random_hub_state_dict(SMALL, seed=2)["h.0.mlp.c_fc.weight"].T
    tensors["blk.0.ffn_up.weight"] = (quantize(up, qtype), qtype)
    path = write_tensors(tmp_path / "m.gguf", SMALL, tensors, "q4_k", TOKENIZER_DIR)
    with caplog.at_level(logging.INFO, logger="max.pipelines"):
        converted = adapt(path)
    assert not [r for r in caplog.records if "blk.0.ffn_up" in r.getMessage()]
    weight = converted["h.0.mlp.c_fc.weight"]
    assert block_type(weight) == qtype.name.lower()
    assert weight.dtype == DType.uint8
    np.testing.assert_array_equal(np.asarray(weight.data), tensors["blk.0.ffn_up.weight"][0])
    assert WeightPlan.of(converted).encoding("h.0.mlp.c_fc.weight") == qtype.name.lower()


UNTIED = GPT2Config(**{**SMALL.to_dict(), "tie_word_embeddings": False})


@pytest.mark.tier("unit")
@pytest.mark.parametrize(
    "file_type, config",
    [("q4_k_m", SMALL), ("q4_k_m", UNTIED), ("f16", SMALL), ("f32", UNTIED), ("q8_0", SMALL)],
)
def test_held_bytes_are_what_the_adapter_hands_over(tmp_path, file_type, config):
    """The memory planner's count of a GGUF, from its header alone, is the bytes the
    adapter's arrays take: a packed tied table's float32 copy for the gather and a
    block type without a kernel (Q4_1) dequantized among them."""
    state = random_hub_state_dict(config, seed=2)
    tensors = gguf_tensors(config, state, file_type)
    up = state["h.0.mlp.c_fc.weight"].T
    tensors["blk.0.ffn_up.weight"] = (quantize(up, Q.Q4_1), Q.Q4_1)
    path = write_tensors(tmp_path / "m.gguf", config, tensors, file_type, TOKENIZER_DIR)
    converted = adapt(path, config)
    held = sum(np.asarray(weight.data).nbytes for weight in converted.values())
    assert held_bytes([path], config) == held
    assert held > sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


@pytest.mark.tier("unit")
@pytest.mark.parametrize("file_type, own_head", [("q4_k_m", True), ("f16", False)])
def test_a_head_llama_cpp_wrote_beside_a_tied_config(tmp_path, file_type, own_head):
    """llama.cpp's converter writes GPT-2's tied head as `output.weight` and its
    quantizer types it apart (Q6_K beside a Q4_K table), served with a hub
    `config.json` that ties them: the packed one is the head llama.cpp multiplies by
    (it was dropped, and the table's Q4_K blocks multiplied instead); a float one is
    the table again and is dropped."""
    tensors = gguf_tensors(UNTIED, random_hub_state_dict(UNTIED, seed=2), file_type)
    path = write_tensors(tmp_path / "m.gguf", SMALL, tensors, file_type, TOKENIZER_DIR)
    converted = adapt(path, SMALL)
    assert held_bytes([path], SMALL) == sum(
        np.asarray(weight.data).nbytes for weight in converted.values())
    if not own_head:
        assert "lm_head.weight" not in converted
        return
    head, qtype = tensors["output.weight"]
    assert (qtype, tensors["token_embd.weight"][1]) == (Q.Q6_K, Q.Q4_K)
    assert block_type(converted["lm_head.weight"]) == "q6_k"
    np.testing.assert_array_equal(np.asarray(converted["lm_head.weight"].data), head)
    assert np.from_dlpack(converted["wte.weight"]).dtype == np.float32


@pytest.mark.tier("unit")
def test_f16_matrices_stay_half_precision_the_rest_is_widened(tmp_path):
    tensors = small_tensors("f16")
    path = write_tensors(tmp_path / "m.gguf", SMALL, tensors, "f16", TOKENIZER_DIR)
    converted = adapt(path)
    half = half_precision_names(SMALL.n_layer)
    for name, weight in converted.items():
        array = np.from_dlpack(weight)
        assert array.dtype == (np.float16 if name in half else np.float32), name
        assert weight.quantization_encoding is None
        stored, qtype = tensors[gguf_name(name)]
        assert qtype == (Q.F16 if array.ndim == 2 else Q.F32)
        np.testing.assert_array_equal(array, stored.astype(array.dtype), err_msg=name)


def replace(tensors, name, data, qtype):
    tensors[name] = (data, qtype)
    return tensors


@pytest.mark.tier("unit")
@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: replace(t, "output_norm.bias", np.zeros(7, np.float32), Q.F32),
            "tensor 'output_norm.bias' has shape (7,); the config implies (256,)",
        ),
        (
            lambda t: replace(
                t, "blk.0.ffn_up.weight", np.zeros((1024, 292), np.uint8), Q.Q8_K
            ),
            "tensor 'blk.0.ffn_up.weight' (blk.0.ffn_up.weight) has GGML type Q8_K",
        ),
        (
            lambda t: t.pop("blk.0.attn_output.bias") and t,
            "GGUF is missing 1 tensor(s), first 'h.0.attn.c_proj.bias'",
        ),
        (
            lambda t: replace(t, "blk.0.attn_q.weight", np.zeros((256, 256), np.float32), Q.F32),
            "unexpected tensor 'blk.0.attn_q.weight'",
        ),
    ],
    ids=["wrong-shape", "unreadable-type", "missing", "unexpected"],
)
def test_broken_gguf_names_the_tensor(tmp_path, edit, message):
    tensors = edit(small_tensors("q4_0"))
    path = write_tensors(tmp_path / "m.gguf", SMALL, tensors, "q4_0", TOKENIZER_DIR)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        adapt(path)


@pytest.mark.tier("unit")
def test_another_architecture_or_disagreeing_metadata_is_refused(tmp_path):
    tensors = small_tensors("f32")
    llama = write_tensors(tmp_path / "l.gguf", SMALL, tensors, "f32", TOKENIZER_DIR, "llama")
    with pytest.raises(CheckpointError, match="holds a 'llama' model"):
        adapt(llama)
    path = write_tensors(tmp_path / "m.gguf", SMALL, tensors, "f32", TOKENIZER_DIR)
    with pytest.raises(CheckpointError, match="gpt2.attention.head_count=4 disagrees"):
        adapt(path, GPT2Config(**{**SMALL.to_dict(), "n_head": 8}))


@pytest.mark.tier("unit")
def test_companion_files_come_from_the_metadata(tmp_path):
    config = GPT2Config(**{**SMALL.to_dict(), "vocab_size": 50257, "tie_word_embeddings": False})
    write_gguf(tmp_path / "m.gguf", config, random_hub_state_dict(config), "q4_0", TOKENIZER_DIR)
    write_companion_files(tmp_path / "m.gguf")
    derived = GPT2Config.from_pretrained(tmp_path)
    for field in ("n_layer", "n_embd", "n_head", "n_inner", "n_positions", "vocab_size"):
        assert getattr(derived, field) == getattr(config, field) or field == "n_inner"
    assert derived.n_inner == 1024
    assert derived.layer_norm_epsilon == 1e-5
    assert derived.tie_word_embeddings is False
    assert derived.architectures == ["GPT2LMHeadModel"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("Hello world")["input_ids"] == [15496, 995]
    assert tokenizer.eos_token_id == 50256
