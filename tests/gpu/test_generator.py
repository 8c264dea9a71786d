"""The in-process `Generator` on the GPU by default: batches, streams, branches and
constraints, in bfloat16."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gpt2_max.generate import Generator
from gpt2_max.testing.reference import random_prompt

from .parity import IN_PROCESS, assert_clear_tokens_match

pytestmark = pytest.mark.tier("gpu")



@pytest.fixture(scope="module")
def on_gpu(gpu_checkpoint):
    """`Generator(checkpoint)` with no device or encoding: MAX's pick, as `max serve`'s."""
    with Generator(gpu_checkpoint, max_batch_size=4, **IN_PROCESS) as generator:
        yield generator


def test_the_default_generator_runs_bfloat16_on_the_gpu(on_gpu):
    model = on_gpu.pipeline_config.model
    assert model.default_device_spec.device_type == "gpu"
    assert model.quantization_encoding == "bfloat16"


def test_batches_pick_transformers_clear_tokens(on_gpu, gpu_reference):
    prompts = [random_prompt(n, seed=9000 + n) for n in (3, 40, 77, 150, 9, 61)]
    completions = on_gpu.generate_batch(prompts, max_new_tokens=24, ignore_eos=True)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert len(completion.token_ids) == 24
        assert_clear_tokens_match(gpu_reference, prompt, completion.token_ids)


def test_a_stream_is_the_completion_in_pieces(on_gpu):
    prompt = random_prompt(12, seed=31)
    pieces = list(on_gpu.stream(prompt, 20, ignore_eos=True))
    assert len(pieces) > 1
    assert "".join(pieces) == on_gpu.generate(prompt, 20, ignore_eos=True).text


def test_branches_are_seeded_and_share_the_prompt(on_gpu):
    prompt = random_prompt(300, seed=32)
    first = on_gpu.branches(prompt, 3, 12, temperature=1.0, seed=5, ignore_eos=True)
    again = on_gpu.branches(prompt, 3, 12, temperature=1.0, seed=5, ignore_eos=True)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) > 1
    assert all(c.cached_tokens > 0 for c in again)


def test_a_json_schema_constraint_holds(on_gpu):
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 6}},
        "required": ["id", "tag"],
        "additionalProperties": False,
    }
    completion = on_gpu.generate("Record:", 48, json_schema=schema)
    jsonschema.validate(json.loads(completion.text), schema)
