"""The default chat template GPT-2 is served with, and a given one taking precedence."""

from __future__ import annotations

import pytest
from max.pipelines.modeling.types import TextGenerationRequestMessage
from transformers import AutoTokenizer

from gpt2_max.tokenizer import PLAIN_CHAT_TEMPLATE, TOKENIZER_DIR, GPT2TextTokenizer

pytestmark = pytest.mark.tier("unit")


def test_plain_template_renders_roles_and_a_generation_prompt():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, chat_template=PLAIN_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert rendered == "System: Be brief.\nUser: Hi\nAssistant: Hello.\nUser: Bye\nAssistant:"


@pytest.mark.tier("model")
def test_a_given_chat_template_wins_over_the_plain_one(checkpoints, max_models):
    """`--chat-template` reaches the tokenizer as `chat_template`; it must be used."""
    folder = checkpoints("default", "hub")
    config = max_models(folder).pipeline_config
    messages = [TextGenerationRequestMessage(role="user", content="Hi")]
    plain = GPT2TextTokenizer(str(folder), config)
    given = GPT2TextTokenizer(str(folder), config, chat_template="<{{ messages[0].content }}>")
    assert plain.apply_chat_template(messages, None) == "User: Hi\nAssistant:"
    assert given.apply_chat_template(messages, None) == "<Hi>"
