"""GPT-2 on the GPU against transformers in float32: tokens where the choice is clear,
log-probabilities within the dtype's reach.

Each continuation is MAX's own greedy decode; transformers then reads the same
tokens in one forward pass (teacher-forced), so every step is compared, also past
a near-tie where the two would part. Figures go to the junit XML report
(`--junitxml`) as properties.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpt2_max.testing.reference import random_prompt

from .parity import BFLOAT16_MARGIN, clear_steps, reference_rows

pytestmark = pytest.mark.tier("gpu")


PROMPTS = [random_prompt(length, seed=8100 + i) for i, length in enumerate((5, 17, 64, 130))]
NEW_TOKENS = 48

TOLERANCES = {
    # encoding: (top-2 margin above which tokens must agree, chosen log-prob tolerance)
    "float32": (1e-2, 5e-3),
    "bfloat16": (BFLOAT16_MARGIN, None),  # as close as transformers' own bfloat16 run
}


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
    margin_floor, tolerance = TOLERANCES[encoding]
    clear = disagree_clear = 0
    ours, theirs_bf16, steps = [], [], 0
    for prompt, (tokens, logprobs) in zip(PROMPTS, greedy_logprobs(model, PROMPTS), strict=True):
        fp32 = reference_rows(reference, prompt, tokens)
        bf16 = reference_rows(reference, prompt, tokens, torch.bfloat16)
        clear_here, differing = clear_steps(fp32, tokens, margin_floor)
        clear, disagree_clear = clear + clear_here, disagree_clear + differing
        chosen = np.arange(len(tokens)), tokens
        ours += list(np.abs(logprobs[chosen] - fp32[chosen]))
        theirs_bf16 += list(np.abs(bf16[chosen] - fp32[chosen]))
        steps += len(tokens)
    figures = {
        "steps": steps,
        "clear_steps": clear,
        "tokens_differing_where_clear": disagree_clear,
        "max_abs_logprob_diff": float(np.max(ours)),
        "mean_abs_logprob_diff": float(np.mean(ours)),
        "hf_bf16_max_abs_logprob_diff": float(np.max(theirs_bf16)),
        "hf_bf16_mean_abs_logprob_diff": float(np.mean(theirs_bf16)),
    }
    for name, value in figures.items():
        record(f"{encoding}_{name}", value)
    assert clear >= steps // 2, f"most steps should be clear choices: {figures}"
    assert disagree_clear == 0, figures
    if tolerance is not None:
        assert figures["max_abs_logprob_diff"] <= tolerance, figures
    return figures


def test_the_default_on_a_gpu_is_bfloat16_as_close_as_transformers_bfloat16(
    gpu_models, gpu_reference, record_property
):
    model = gpu_models(None)
    assert model.pipeline_config.model.quantization_encoding == "bfloat16"
    figures = compare(model, gpu_reference, "bfloat16", record_property)
    assert figures["mean_abs_logprob_diff"] <= figures["hf_bf16_mean_abs_logprob_diff"], figures


def test_float32_on_a_gpu_matches_transformers_float32(gpu_models, gpu_reference, record_property):
    model = gpu_models("float32")
    assert model.pipeline_config.model.quantization_encoding == "float32"
    compare(model, gpu_reference, "float32", record_property)
