"""Truncated safetensors files, and a tensor two of them hold, are refused by name before
MAX maps them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from gpt2_max.testing.reference import write_tiny_checkpoint
from gpt2_max.weights.files import IncompleteCheckpointError
from gpt2_max.weights.formats import check_complete
from gpt2_max.weights.schema import CheckpointError

pytestmark = pytest.mark.tier("unit")


def test_complete_checkpoint_passes(tmp_path):
    check_complete(sorted(write_tiny_checkpoint(tmp_path).iterdir()))


@pytest.mark.parametrize("keep", [0.5, 0.999, 4 / 21919480])
def test_truncated_file_is_refused_naming_it(tmp_path, keep):
    weights = write_tiny_checkpoint(tmp_path) / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(IncompleteCheckpointError, match="model.safetensors"):
        check_complete([weights])


def test_a_length_field_past_the_end_of_the_file_is_refused_naming_it(tmp_path):
    weights = write_tiny_checkpoint(tmp_path) / "model.safetensors"
    weights.write_bytes((2**60).to_bytes(8, "little") + weights.read_bytes()[8:])
    with pytest.raises(IncompleteCheckpointError, match="model.safetensors is damaged or trunc"):
        check_complete([weights])


def split(folder: Path, overlap: int) -> list[Path]:
    """`folder`'s checkpoint as two shards, the last `overlap` tensors of the first also
    in the second."""
    state = load_file(folder / "model.safetensors")
    names = sorted(state)
    half = len(names) // 2
    (folder / "model.safetensors").unlink()
    shards = [folder / "model-00001-of-00002.safetensors",
              folder / "model-00002-of-00002.safetensors"]
    save_file({n: state[n] for n in names[:half]}, shards[0])
    save_file({n: state[n] for n in names[half - overlap:]}, shards[1])
    return shards


def test_shards_pass(tmp_path):
    check_complete(split(write_tiny_checkpoint(tmp_path), overlap=0))


def test_a_tensor_in_two_files_is_refused_naming_both(tmp_path):
    """MAX reads every safetensors file under the folder, an older copy in a subfolder
    too, and took each tensor from one of them: the checkpoints were mixed."""
    folder = write_tiny_checkpoint(tmp_path)
    (folder / "old").mkdir()
    shutil.copy(folder / "model.safetensors", folder / "old" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"is in both .*model.safetensors and "
                                              r".*old/model.safetensors: MAX reads every"):
        check_complete([folder / "model.safetensors", folder / "old" / "model.safetensors"])
    with pytest.raises(CheckpointError, match="is in both"):
        check_complete(split(folder, overlap=1))


def test_a_parameter_under_both_its_names_is_refused(tmp_path):
    folder = write_tiny_checkpoint(tmp_path)
    state = load_file(folder / "model.safetensors")
    key = next(k for k in state if k.endswith("wte.weight"))
    other = key.removeprefix("transformer.") if key.startswith("transformer.") else (
        f"transformer.{key}")
    save_file({**state, other: state[key]}, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors holds both"):
        check_complete([folder / "model.safetensors"])
