"""`weight_files`: the package's check of local weight files runs before MAX reads them, and
a checkpoint folder saved in half precision gets its files named for MAX to find."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from max.driver import DeviceSpec
from max.pipelines import AutoModel
from max.pipelines.lib.config.config import PipelineConfig
from max.pipelines.lib.config.model_config import MAXModelConfig
from max.pipelines.weights.hf_utils import HuggingFaceRepo
from safetensors.torch import load_file, save_file

from gpt2_max.arch import gpt2_arch
from gpt2_max.shims import weight_files
from gpt2_max.testing.reference import (
    hf_greedy,
    load_reference,
    random_prompt,
    saved_in,
    write_tiny_checkpoint,
)
from gpt2_max.tokenizer import GPT2TextTokenizer
from gpt2_max.weights.files import IncompleteCheckpointError, holds_half_precision
from gpt2_max.weights.formats import check_complete

pytestmark = pytest.mark.tier("unit")


def model_of(folder, weight_path=()):
    repo = SimpleNamespace(repo_type="local", local_path=str(folder),
                           weight_files={"safetensors": ["model.safetensors"]})
    return SimpleNamespace(huggingface_weight_repo=repo, weight_path=list(weight_path))


def test_a_local_folder_gives_its_weight_files_or_the_ones_named(tmp_path):
    assert weight_files.local_weight_files(model_of(tmp_path)) == [tmp_path / "model.safetensors"]
    named = tmp_path / "other.safetensors"
    assert weight_files.local_weight_files(model_of(tmp_path, [named])) == [named]
    online = SimpleNamespace(huggingface_weight_repo=SimpleNamespace(repo_type="online"))
    assert weight_files.local_weight_files(online) == []


def test_a_damaged_file_of_this_architecture_is_named_before_maxs_resolution(tmp_path):
    folder = write_tiny_checkpoint(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes((2**60).to_bytes(8, "little") + weights.read_bytes()[8:])
    weight_files.install(GPT2TextTokenizer, check_complete, holds_half_precision)
    resolve = PipelineConfig._model_with_resolved_weights
    assert resolve.checks_weight_files
    ours = SimpleNamespace(tokenizer=GPT2TextTokenizer)
    with pytest.raises(IncompleteCheckpointError, match="claim a 1152921504606846976-byte"):
        resolve(model_of(folder), ours)
    weight_files.install(GPT2TextTokenizer, check_complete, holds_half_precision)
    assert PipelineConfig._model_with_resolved_weights is resolve



def half(folder, dtype: str):
    return saved_in(write_tiny_checkpoint(folder), getattr(torch, dtype))


def named(folder, weight_path=()):
    model = SimpleNamespace(huggingface_weight_repo=HuggingFaceRepo(str(folder)),
                            weight_path=list(weight_path))
    return weight_files.half_float_files(model, holds_half_precision)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_folder_gets_its_files_named(tmp_path, dtype):
    """MAX 26.7 finds no files for a float32 graph in it, and refuses the folder."""
    folder = half(tmp_path / "half", dtype)
    assert named(folder) == [folder / "model.safetensors"]
    assert named(folder, ["model.safetensors"]) == []  # named already
    mixed = half(tmp_path / "mixed", dtype)
    state = load_file(mixed / "model.safetensors")
    save_file({**state, "wpe.weight": state["wpe.weight"].float()}, mixed / "model.safetensors")
    assert named(mixed) == []  # MAX finds the float32 tensor's file
    assert named(write_tiny_checkpoint(tmp_path / "float32")) == []


def with_mask_buffers(folder, dtype: torch.dtype):
    """`folder` with its causal-mask buffers in `dtype`, as older transformers saved
    them (uint8, later bool) beside the weights whatever their precision."""
    state = load_file(folder / "model.safetensors")
    masks = [name for name in state if name.endswith("attn.bias") and state[name].dim() == 4]
    assert masks
    save_file({**state, **{name: state[name].to(dtype) for name in masks}},
              folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("buffers", [torch.uint8, torch.bool])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mask_buffers_of_another_dtype_leave_a_half_precision_folder_half(
    tmp_path, dtype, buffers
):
    """MAX reads a uint8 tensor as the float4_e2m1fnx2 encoding, so it refused a float16
    folder with uint8 masks ("compatible weights cannot be found for 'float32'"); the
    masks are not parameters, and the adapter drops them."""
    folder = with_mask_buffers(half(tmp_path, dtype), buffers)
    assert named(folder) == [folder / "model.safetensors"]
    weight_files.install(GPT2TextTokenizer, check_complete, holds_half_precision)
    model = MAXModelConfig(model_path=str(folder), device_specs=[DeviceSpec.cpu()])
    resolved = PipelineConfig._model_with_resolved_weights(model, gpt2_arch)
    assert resolved.quantization_encoding == "float32"
    assert [Path(p) for p in resolved.weight_path] == [folder / "model.safetensors"]


RESOLVED = {
    ("cpu", None): "float32", ("cpu", "float32"): "float32", ("cpu", "bfloat16"): None,
    ("gpu", None): "bfloat16", ("gpu", "float32"): "float32", ("gpu", "bfloat16"): "bfloat16",
}
"""The encoding MAX resolves for a half-precision folder on a device, given none or one
asked for, as for a float32 folder (None: refused, naming the device)."""


@pytest.mark.parametrize("device, asked", sorted(RESOLVED, key=str))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_maxs_resolution_of_a_half_precision_folder_is_a_float32_folders(
    tmp_path, dtype, device, asked
):
    """Through MAX's own resolution with the architecture (a GPU's is only a spec
    here): the device's default or the encoding asked for, and the folder's file."""
    weight_files.install(GPT2TextTokenizer, check_complete, holds_half_precision)
    folder = half(tmp_path, dtype)
    spec = DeviceSpec.cpu() if device == "cpu" else DeviceSpec.accelerator()
    model = MAXModelConfig(model_path=str(folder), device_specs=[spec],
                           **({} if asked is None else {"quantization_encoding": asked}))
    resolve = PipelineConfig._model_with_resolved_weights
    if RESOLVED[device, asked] is None:
        with pytest.raises(ValueError, match="not compatible with the selected device"):
            resolve(model, gpt2_arch)
        return
    resolved = resolve(model, gpt2_arch)
    assert resolved.quantization_encoding == RESOLVED[device, asked]
    assert [Path(p) for p in resolved.weight_path] == [folder / "model.safetensors"]


@pytest.mark.tier("model")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_folder_loads_on_the_cpu_as_transformers_reads_it(tmp_path, dtype):
    """As typed, no `--weight-path`: before, MAX refused it ("compatible weights cannot
    be found for 'float32'")."""
    folder = half(tmp_path, dtype)
    model = AutoModel(str(folder), max_batch_size=2, devices="cpu",
                      custom_architectures=["gpt2_max"])
    try:
        assert model.pipeline_config.model.quantization_encoding == "float32"
        prompt = random_prompt(24, seed=41)
        result = model.generate([prompt], max_new_tokens=8, top_k=1, ignore_eos=True)
        expected = hf_greedy(load_reference(folder), prompt, 8)[0]
        assert list(result.sequences[0][len(prompt):]) == expected
    finally:
        model.close()
