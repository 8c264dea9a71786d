"""The core on its own: GPT-2 built from MAX's plain layers, no fast path, is exact.

`layers.Layers` is what a copier of this package starts from; here it serves
the default checkpoint on the CPU in place of `FastLayers`, and must match
transformers as the fast layers do.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from max.pipelines import AutoModel

from gpt2_max import model as gpt2_model
from gpt2_max.layers import Layers
from gpt2_max.testing.reference import hf_greedy, random_prompt

NEW_TOKENS = 8


@pytest.fixture
def plain_model(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(gpt2_model, "layers_for", Layers)
    folder = shutil.copytree(checkpoints("default", "hub"), tmp_path / "checkpoint")
    model = AutoModel(
        str(folder), max_batch_size=2, devices="cpu", custom_architectures=["gpt2_max"]
    )
    yield model
    model.close()


def test_plain_layers_match_transformers(plain_model, hf_models):
    prompts = [random_prompt(5, seed=7001), random_prompt(33, seed=7002)]
    result = plain_model.generate(
        prompts, max_new_tokens=NEW_TOKENS, top_k=1, ignore_eos=True, output_logits=True
    )
    for prompt, sequence, logits in zip(prompts, result.sequences, result.logits, strict=True):
        hf_tokens, hf_logits = hf_greedy(hf_models("default"), prompt, NEW_TOKENS)
        assert sequence[len(prompt):] == hf_tokens
        np.testing.assert_allclose(logits, hf_logits, atol=1e-4, rtol=0)
