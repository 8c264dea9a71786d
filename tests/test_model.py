"""The compiled model keeps its own weights, so the checkpoint file is let go; weights
holding NaN are refused before the compile; and the GPU's load and graph,
cross-compiled here without a GPU.

MAX reads CPU weights in place; the safetensors adapter copies every tensor and
`GPT2PipelineModel.load_model` closes the file, whose pages would otherwise stay
resident beside those copies for the server's lifetime.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from max.pipelines import AutoModel
from safetensors.torch import load_file, save_file

from gpt2_max.names import PACKAGE
from gpt2_max.testing.reference import (
    hf_greedy,
    load_reference,
    random_prompt,
    save_gguf,
    saved_in,
    write_tiny_checkpoint,
)
from gpt2_max.testing.server import child_env, max_executable
from gpt2_max.weights.schema import CheckpointError

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


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_a_checkpoint_with_nan_weights_is_refused_before_the_compile(tmp_path, kind):
    """It loaded and answered every request with tokens drawn from NaN logits."""
    folder = write_tiny_checkpoint(tmp_path / "nan")
    state = load_file(folder / "model.safetensors")
    state["h.1.mlp.c_fc.weight"][3, :7] = float("nan")
    save_file(state, folder / "model.safetensors")
    weights = {}
    if kind == "gguf":
        path = save_gguf(load_reference(folder), tmp_path / "gguf", "f16")
        folder, weights = path.parent, {"weight_path": [str(path)]}
    with pytest.raises(CheckpointError, match=r"tensor 'h.1.mlp.c_fc.weight' holds 7 NaN"):
        AutoModel(str(folder), max_batch_size=1, devices="cpu",
                  custom_architectures=[PACKAGE], **weights)


@pytest.mark.parametrize("weights", ["float16 folder", "q8_0 gguf"])
def test_the_gpu_load_and_graph_compile_for_a_card_without_one(weights, tmp_path):
    """`max warm-cache --target cuda:sm_90`: MAX's virtual GPU, on this CPU machine. The
    GPU's path through the package up to the first step runs here as on a card: MAX's
    resolution of the folder (a float16 one, which MAX read as an encoding the
    architecture does not declare), the plain layers' `prepare` (a packed GGUF's
    blocks dequantized, the head padded) and the bfloat16 graph's compile for Hopper.
    Its values are not computed (no device), so this says nothing of the tokens: the
    `gpu` tier does, on a card."""
    folder = write_tiny_checkpoint(tmp_path / "checkpoint")
    if weights == "float16 folder":
        saved_in(folder, torch.float16)
        flags = []
    else:
        path = save_gguf(load_reference(folder), tmp_path / "gguf", "q8_0")
        folder, flags = path.parent, ["--weight-path", str(path)]
    done = subprocess.run(
        [max_executable(), "warm-cache", "--custom-architectures", PACKAGE,
         "--model", str(folder), *flags, "--target", "cuda:sm_90"],
        env=child_env(MODULAR_TELEMETRY_ENABLED="0"), capture_output=True, text=True,
        timeout=1800,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert f"{PACKAGE}: compiling the GPT-2 graph for bfloat16" in log, log[-3000:]
    assert "Compiling GPT2 took" in log
    if weights == "q8_0 gguf":
        assert "packed GGUF tensor(s) (q8_0) dequantized to bfloat16 at load" in log
