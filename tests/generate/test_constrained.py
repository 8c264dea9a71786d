"""Grammar-constrained generation: always valid, and exactly the masked greedy choice.

The model has random weights, so nothing but the grammar mask makes its output
parse; every request is validated with `jsonschema`. Greedy constrained output
is also reproduced with transformers and the same llguidance matcher, forced
tokens included, which checks the multi-token fast-forward steps token for token.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from llguidance import LLMatcher
from max.driver import CPU, Buffer
from max.pipelines.context import ProcessorInputs
from transformers import AutoTokenizer

from gpt2_max.generate.constrained import (
    JSON_OPTIONS,
    GrammarMask,
    compile_constraint,
    llg_tokenizer,
)
from gpt2_max.model_config import GPT2_VOCAB_SIZE
from gpt2_max.tools.checkpoint import TOKENIZER_DIR

pytestmark = pytest.mark.tier("model")

NAME = {"type": "string", "maxLength": 8}
SCHEMAS = {
    "record": {
        "type": "object",
        "properties": {
            "name": NAME,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "member": {"type": "boolean"},
        },
        "required": ["name", "age", "member"],
        "additionalProperties": False,
    },
    "long-keys": {
        "type": "object",
        "properties": {
            "customerFirstName": {"enum": ["Ann", "Bob", "Cleo"]},
            "shippingAddressLine": NAME,
            "orderQuantity": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["customerFirstName", "shippingAddressLine", "orderQuantity"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                               "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["point", "tags"],
        "additionalProperties": False,
    },
    "choice": {"enum": ["red", "green", "blue", "teal"]},
}
PROMPTS = ["Customer record:", "Here is the JSON:", "Output ->", "{ data }"]
MAX_NEW = 80


def hf_constrained_greedy(model, tokenizer, prompt: list[int], grammar: str) -> list[int]:
    """Masked greedy decoding with transformers, forcing what the grammar forces."""
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    tokens: list[int] = []
    with torch.no_grad():
        while True:
            forced = matcher.compute_ff_tokens()
            assert matcher.consume_tokens(forced)
            tokens += forced
            if matcher.is_stopped():
                return tokens
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].numpy()
            allowed = np.unpackbits(
                np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
            )[: logits.shape[0]]
            token = int(np.where(allowed == 1, logits, -np.inf).argmax())
            tokens.append(token)
            if token == tokenizer.eos_token:
                return tokens
            assert matcher.consume_token(token)


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_validates(generator, name):
    schema = SCHEMAS[name]
    greedy = generator.generate_batch(PROMPTS, MAX_NEW, json_schema=schema)
    sampled = generator.generate_batch(
        PROMPTS, MAX_NEW, json_schema=json.dumps(schema), temperature=1.0, seed=len(name)
    )
    for result in greedy + sampled:
        assert result.finish_reason == "stop", result
        jsonschema.validate(json.loads(result.text), schema)
        assert len(result.token_ids) == result.steps + result.forced_tokens


def test_branches_under_a_schema_validate_and_differ(generator):
    schema = SCHEMAS["record"]
    results = generator.branches("Record:", 4, MAX_NEW, json_schema=schema, temperature=1.0)
    for result in results:
        jsonschema.validate(json.loads(result.text), schema)
    assert len({r.text for r in results}) > 1


def test_fast_forward_runs_forced_tokens_inside_steps(generator):
    results = generator.generate_batch(PROMPTS, MAX_NEW, json_schema=SCHEMAS["long-keys"])
    for result in results:
        # Three long keys and their quotes are forced, not sampled one step each.
        assert result.forced_tokens >= 9
        assert result.steps < len(result.token_ids)


@pytest.mark.parametrize("name", ["long-keys", "nested", "array"])
def test_constrained_greedy_matches_transformers(generator, hf_models, name):
    grammar = LLMatcher.grammar_from_json_schema(SCHEMAS[name], overrides=JSON_OPTIONS)
    tokenizer = generator.grammar_tokenizer
    for prompt_text in PROMPTS[:2]:
        prompt = generator.tokenizer.encode(prompt_text)
        result = generator.generate(prompt, MAX_NEW, json_schema=SCHEMAS[name])
        expected = hf_constrained_greedy(hf_models("default"), tokenizer, prompt, grammar)
        assert result.token_ids == expected


def test_regex_and_lark_grammar(generator):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    grammar = (
        'start: answer " because " reason\nanswer: "yes" | "no" | "maybe"\nreason: /[a-z]{1,6}/'
    )
    for seed in range(3):
        by_regex = generator.generate("Code:", 20, regex=pattern, temperature=1.0, seed=seed)
        assert re.fullmatch(pattern, by_regex.text), by_regex.text
        by_lark = generator.generate("Well?", 20, grammar=grammar, temperature=1.0, seed=seed)
        assert re.fullmatch(r"(yes|no|maybe) because [a-z]{1,6}", by_lark.text), by_lark.text


class DeviceRow:
    """A logits row as MAX hands it to a processor on a GPU: `to_numpy` copies it to
    the host, and only `inplace_copy_from` changes it."""

    is_host = False
    device = CPU()

    def __init__(self, values: np.ndarray) -> None:
        self.buffer = Buffer.from_numpy(values)

    def to_numpy(self) -> np.ndarray:
        return self.buffer.to_numpy().copy()

    def inplace_copy_from(self, other: Buffer) -> None:
        self.buffer.inplace_copy_from(other)


@pytest.mark.tier("unit")
def test_the_mask_reaches_logits_on_a_device():
    tokenizer = llg_tokenizer(AutoTokenizer.from_pretrained(TOKENIZER_DIR), GPT2_VOCAB_SIZE)
    grammar = compile_constraint(tokenizer, "regex", "Hello")
    mask = GrammarMask(LLMatcher(tokenizer, grammar), tokenizer.vocab_size)
    row = DeviceRow(np.zeros((1, GPT2_VOCAB_SIZE), dtype=np.float32))
    mask(ProcessorInputs(logits=row, context=None))
    allowed = np.isfinite(row.buffer.to_numpy()[0])
    assert 0 < allowed.sum() < GPT2_VOCAB_SIZE
    assert allowed[AutoTokenizer.from_pretrained(TOKENIZER_DIR).encode("Hello")[0]]
