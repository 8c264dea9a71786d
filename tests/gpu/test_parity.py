"""GPT-2 on the GPU against transformers in float32: tokens where the choice is clear,
log-probabilities within the dtype's reach.

Each continuation is MAX's own greedy decode; transformers then reads the same
tokens in one forward pass (teacher-forced), so every step is compared, also past
a near-tie where the two would part. Figures go to the junit XML report
(`--junitxml`) as properties.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from max.pipelines import AutoModel
from transformers import GPT2LMHeadModel

from gpt2_max.names import PACKAGE
from gpt2_max.testing.reference import (
    TINY_HEAD64,
    hf_on_gguf_weights,
    load_reference,
    random_prompt,
    random_state_dict,
    save_gguf,
    saved_in,
    write_tiny_checkpoint,
)
from gpt2_max.tools.checkpoint import preset_config, save_hub_checkpoint

from .parity import BFLOAT16_MARGIN, GPU_STD, IN_PROCESS, clear_steps, reference_rows

pytestmark = pytest.mark.tier("gpu")


PROMPTS = [random_prompt(length, seed=8100 + i) for i, length in enumerate((5, 17, 64, 130))]
NEW_TOKENS = 48

PEERS = {
    # encoding: (top-2 margin above which tokens must agree, transformers' run at its
    # precision, how many times that run's error ours may reach)
    "float32": (1e-2, {"dtype": torch.float32, "tf32": True}, 2.0),
    "bfloat16": (BFLOAT16_MARGIN, {"dtype": torch.bfloat16}, 1.0),
}
"""Chosen-token log-probabilities are held to transformers' own run at the encoding's
precision, both against transformers float32: bfloat16 at least as close (mean), and
float32 on TF32 tensor cores, where MAX runs float32 matmuls of more than one row with
no switch to turn it off (`docs/max-26.7.md`), within twice its error, mean and
largest: TF32's error grows with the width a product sums over, so no one bound fits
every shape, and MAX's products sum in another order than torch's. No step's error
may pass twice the peer's largest."""


def greedy_logprobs(model, prompts: list[list[int]]) -> list[tuple[list[int], np.ndarray]]:
    """MAX's greedy tokens of each prompt and the log-softmax of the logits it sampled from."""
    result = model.generate(
        prompts, max_new_tokens=NEW_TOKENS, top_k=1, ignore_eos=True, output_logits=True
    )
    out = []
    for prompt, sequence, logits in zip(prompts, result.sequences, result.logits, strict=True):
        logits = torch.from_numpy(np.asarray(logits, dtype=np.float64))
        out.append((list(sequence[len(prompt):]), torch.log_softmax(logits, -1).numpy()))
    return out


def compare(model, reference, encoding: str, record) -> dict[str, float]:
    margin_floor, peer, slack = PEERS[encoding]
    clear = disagree_clear = 0
    ours, theirs, steps = [], [], 0
    for prompt, (tokens, logprobs) in zip(PROMPTS, greedy_logprobs(model, PROMPTS), strict=True):
        fp32 = reference_rows(reference, prompt, tokens)
        peer_rows = reference_rows(reference, prompt, tokens, **peer)
        clear_here, differing = clear_steps(fp32, tokens, margin_floor)
        clear, disagree_clear = clear + clear_here, disagree_clear + differing
        chosen = np.arange(len(tokens)), tokens
        ours += list(np.abs(logprobs[chosen] - fp32[chosen]))
        theirs += list(np.abs(peer_rows[chosen] - fp32[chosen]))
        steps += len(tokens)
    figures = {
        "steps": steps,
        "clear_steps": clear,
        "tokens_differing_where_clear": disagree_clear,
        "max_abs_logprob_diff": float(np.max(ours)),
        "mean_abs_logprob_diff": float(np.mean(ours)),
        "peer_max_abs_logprob_diff": float(np.max(theirs)),
        "peer_mean_abs_logprob_diff": float(np.mean(theirs)),
    }
    for name, value in figures.items():
        record(f"{encoding}_{name}", value)
    assert clear >= steps // 2, f"most steps should be clear choices: {figures}"
    assert disagree_clear == 0, figures
    mean, peer_mean = figures["mean_abs_logprob_diff"], figures["peer_mean_abs_logprob_diff"]
    assert mean <= slack * peer_mean, figures
    assert figures["max_abs_logprob_diff"] <= 2 * figures["peer_max_abs_logprob_diff"], figures
    return figures


def test_the_default_on_a_gpu_is_bfloat16_as_close_as_transformers_bfloat16(
    gpu_models, gpu_reference, record_property
):
    model = gpu_models(None)
    assert model.pipeline_config.model.quantization_encoding == "bfloat16"
    compare(model, gpu_reference, "bfloat16", record_property)


def test_float32_on_a_gpu_matches_transformers_float32(gpu_models, gpu_reference, record_property):
    model = gpu_models("float32")
    assert model.pipeline_config.model.quantization_encoding == "float32"
    compare(model, gpu_reference, "float32", record_property)


SHAPES = ("gpt2", "gpt2-xl")
"""The served family's smallest common shape and its largest, at the tier's spread: their
widths, depths and head counts, not only the tiny checkpoint's head size."""


@pytest.fixture(scope="module", params=SHAPES)
def shaped(request, tmp_path_factory) -> tuple[Path, GPT2LMHeadModel]:
    """A random checkpoint of a family member's shape and transformers' reading of it."""
    config = preset_config(request.param)
    folder = save_hub_checkpoint(
        tmp_path_factory.mktemp(request.param), config,
        random_state_dict(config, seed=3, std=GPU_STD),
    )
    return folder, load_reference(folder)


@pytest.mark.parametrize("encoding", ["bfloat16", "float32"])
def test_family_shapes_on_a_gpu_match_transformers(shaped, encoding, record_property):
    folder, reference = shaped
    model = AutoModel(
        str(folder), devices="gpu", max_batch_size=4, custom_architectures=[PACKAGE],
        quantization_encoding=encoding, **IN_PROCESS,
    )
    try:
        compare(model, reference, encoding, record_property)
    finally:
        model.close()


@pytest.mark.parametrize("file_type, encoding", [("q8_0", None), ("q4_k_m", "bfloat16")])
def test_a_quantized_gguf_on_a_gpu_loads_its_blocks_dequantized(
    gpu_reference, file_type, encoding, tmp_path, record_property
):
    """A packed GGUF on the card: `gpt2-q8_0.gguf` as typed (MAX reads no encoding from
    that name, so bfloat16), and a Q4_K_M file, whose name MAX reads as the CPU's
    `q4_k`, with bfloat16 asked for. Each loads its blocks dequantized and is as close
    to transformers on the same dequantized weights as a float checkpoint is."""
    path = save_gguf(gpu_reference, tmp_path / file_type, file_type)
    model = AutoModel(
        str(path.parent), weight_path=[str(path)], devices="gpu", max_batch_size=4,
        custom_architectures=[PACKAGE], **IN_PROCESS,
        **({} if encoding is None else {"quantization_encoding": encoding}),
    )
    try:
        assert model.pipeline_config.model.quantization_encoding == "bfloat16"
        assert all(spec.device_type == "gpu" for spec in model.pipeline_config.model.device_specs)
        compare(model, hf_on_gguf_weights(gpu_reference, path), "bfloat16", record_property)
    finally:
        model.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_checkpoint_on_a_gpu_matches_transformers(
    dtype, tmp_path, record_property
):
    """A folder saved in float16 (whose files MAX read as an encoding the architecture
    does not declare) or bfloat16, loaded as typed: bfloat16, as close to transformers
    on the same weights as a float32 checkpoint is."""
    folder = saved_in(
        write_tiny_checkpoint(tmp_path, seed=3, std=GPU_STD, **TINY_HEAD64), dtype
    )
    model = AutoModel(
        str(folder), devices="gpu", max_batch_size=4, custom_architectures=[PACKAGE],
        **IN_PROCESS,
    )
    try:
        assert model.pipeline_config.model.quantization_encoding == "bfloat16"
        compare(model, load_reference(folder), "bfloat16", record_property)
    finally:
        model.close()
