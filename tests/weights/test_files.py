"""Truncated safetensors files are refused by name before MAX maps them."""

from __future__ import annotations

import pytest

from gpt2_max.testing.reference import write_tiny_checkpoint
from gpt2_max.weights.files import IncompleteCheckpointError
from gpt2_max.weights.formats import check_complete

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
