"""`shims.answer_text`: MAX's detokenizer primed with a prompt that ends inside a
character writes the prompt's text into the answer (the behaviour the shim leans on,
checked so a release that mends it is noticed); gpt2-max's start empty, others are left
as MAX primes them.

The served answer after such a prompt is tested in `tests/test_serve.py`.
"""

from __future__ import annotations

import asyncio

import pytest
from max.serve.pipelines import llm
from transformers import AutoTokenizer

from gpt2_max.shims import answer_text
from gpt2_max.tokenizer import TOKENIZER_DIR, GPT2TextTokenizer

pytestmark = pytest.mark.tier("unit")

PROMPT = [15496, 30325]
""""Hello", then a token holding an emoji's first bytes."""
ANSWER = [8539, 6699, 29831]


class Tokenizer(GPT2TextTokenizer):
    """gpt2-max's tokenizer type around the vendored GPT-2 tokenizer, unloaded."""

    def __init__(self, delegate) -> None:
        self.delegate = delegate


class Other:
    """Another architecture's tokenizer."""

    def __init__(self, delegate) -> None:
        self.delegate = delegate


def text(create, tokenizer) -> str:
    detokenizer = create(tokenizer, PROMPT, skip_special_tokens=True)
    return "".join(asyncio.run(detokenizer.decode([token])) for token in ANSWER)


def test_an_answer_is_its_own_tokens_text_after_a_prompt_ending_inside_a_character():
    delegate = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    answer = delegate.decode(ANSWER)
    assert delegate.decode(PROMPT).endswith("\ufffd")
    answer_text.install(Tokenizer)
    create = llm.create_buffered_detokenizer
    assert create.answer_alone
    assert text(create.__wrapped__, Tokenizer(delegate)) == delegate.decode(PROMPT) + answer
    assert text(create, Tokenizer(delegate)) == answer
    assert text(create, Other(delegate)).startswith("Hello")  # as MAX primes it
