"""The compiled model keeps its own weights, so the checkpoint file is let go.

MAX reads CPU weights in place; the safetensors adapter copies every tensor and
`GPT2PipelineModel.load_model` closes the file, whose pages would otherwise stay
resident beside those copies for the server's lifetime.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from gpt2_max.model import GPU_BFLOAT16_WARNING, warn_if_known_wrong
from gpt2_max.testing.reference import hf_greedy, random_prompt

pytestmark = pytest.mark.tier("model")


def test_the_checkpoint_is_unmapped_and_the_model_still_exact(
    checkpoints, hf_models, max_models, tmp_path
):
    # A copy no other test (nor the transformers reference) has opened.
    folder = shutil.copytree(checkpoints("default", "hub"), tmp_path / "checkpoint")
    model = max_models(folder)
    assert str((folder / "model.safetensors").resolve()) not in Path("/proc/self/maps").read_text()
    prompt = random_prompt(70, seed=4242)
    result = model.generate([prompt], max_new_tokens=16, top_k=1, ignore_eos=True)
    assert result.sequences[0][len(prompt):] == hf_greedy(hf_models("default"), prompt, 16)[0]


@pytest.mark.tier("unit")
@pytest.mark.parametrize(
    ("encoding", "on_host", "warned"),
    [("bfloat16", False, True), ("float32", False, False), ("float32", True, False)],
)
def test_a_bfloat16_load_on_an_accelerator_says_it_is_known_wrong(
    encoding, on_host, warned, caplog
):
    with caplog.at_level(logging.WARNING, logger="max.pipelines"):
        warn_if_known_wrong(encoding, on_host)
    assert (GPU_BFLOAT16_WARNING in caplog.text) == warned
