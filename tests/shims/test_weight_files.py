"""`weight_files`: the package's check of local weight files runs before MAX reads them."""

from types import SimpleNamespace

import pytest
from max.pipelines.lib.config.config import PipelineConfig

from gpt2_max.shims import weight_files
from gpt2_max.testing.reference import write_tiny_checkpoint
from gpt2_max.tokenizer import GPT2TextTokenizer
from gpt2_max.weights.files import IncompleteCheckpointError
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
    weight_files.install(GPT2TextTokenizer, check_complete)
    resolve = PipelineConfig._model_with_resolved_weights
    assert resolve.checks_weight_files
    ours = SimpleNamespace(tokenizer=GPT2TextTokenizer)
    with pytest.raises(IncompleteCheckpointError, match="claim a 1152921504606846976-byte"):
        resolve(model_of(folder), ours)
    weight_files.install(GPT2TextTokenizer, check_complete)
    assert PipelineConfig._model_with_resolved_weights is resolve
