"""Parity of the compiled GPT-2 graph with Hugging Face transformers.

Each MAX run batches prompts of different lengths into one ragged step, then
decodes them together through the paged KV cache; every step's next-token
logits and the greedy tokens are compared with transformers' own cached decode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from max.experimental.tensor import Tensor
from transformers.activations import ACT2FN

from gpt2_max.layers.mlp import activation
from gpt2_max.model_config import ACTIVATIONS, GPT2_VOCAB_SIZE
from gpt2_max.testing.reference import hf_greedy, random_prompt
from tests.conftest import LAYOUTS, PADDED_VOCAB_SIZE, VARIANTS

pytestmark = pytest.mark.tier("model")

NEW_TOKENS = 32
LOGITS_ATOL = 1e-4
"""About three times the largest difference measured over these cases (README)."""

CASES = [(variant, layout) for variant in VARIANTS for layout in LAYOUTS]
"""Every (variant, layout); its index seeds its prompts, so no two share one."""


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    """Prompts seeded `seed * 10 + i`: distinct across distinct `seed`s."""
    return [random_prompt(n, seed=seed * 10 + i) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("variant, layout", CASES)
def test_batched_greedy_decode_matches_transformers(
    variant, layout, hf_models, checkpoints, max_models
):
    prompts = random_prompts((1, 9, 40, 150), seed=CASES.index((variant, layout)))
    result = max_models(checkpoints(variant, layout)).generate(
        prompts, max_new_tokens=NEW_TOKENS, top_k=1, ignore_eos=True, output_logits=True
    )
    for prompt, sequence, logits in zip(prompts, result.sequences, result.logits, strict=True):
        hf_tokens, hf_logits = hf_greedy(hf_models(variant), prompt, NEW_TOKENS)
        assert sequence[len(prompt):] == hf_tokens
        vocab = hf_logits.shape[1]
        np.testing.assert_allclose(logits[:, :vocab], hf_logits, atol=LOGITS_ATOL, rtol=0)
        # Ids past the tokenizer's vocabulary (padded embedding rows) are masked.
        assert np.all(logits[:, vocab:] == -np.inf)


@pytest.mark.tier("unit")
def test_padded_rows_would_win_unmasked(hf_models):
    """The padded variant exercises the mask: transformers, unmasked, picks padding."""
    model = hf_models("relu-untied-padded-unscaled-layer-scaled")
    assert model.config.vocab_size == PADDED_VOCAB_SIZE
    prompts = random_prompts((1, 9, 40, 150), seed=len(CASES))
    with torch.no_grad():
        picks = [int(model(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    assert all(pick >= GPT2_VOCAB_SIZE for pick in picks), picks


def test_kv_cache_is_reused_across_batches(hf_models, checkpoints, max_models):
    """A second batch on the same model starts from clean cache rows."""
    model = max_models(checkpoints("default", "hub"))
    for seed in (len(CASES) + 1, len(CASES) + 2):
        (prompt,) = random_prompts((60,), seed)
        result = model.generate([prompt], max_new_tokens=8, top_k=1, ignore_eos=True)
        assert result.sequences[0][len(prompt):] == hf_greedy(
            hf_models("default"), prompt, 8
        )[0]


@pytest.mark.parametrize("config_name", sorted(ACTIVATIONS))
def test_activation_matches_transformers(config_name):
    x = np.linspace(-8.0, 8.0, 257, dtype=np.float32)
    ours = activation(ACTIVATIONS[config_name], Tensor.from_dlpack(x)).to_numpy()
    theirs = ACT2FN[config_name](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
