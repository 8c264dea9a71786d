"""The default chat template GPT-2 is served with."""

from __future__ import annotations

from transformers import AutoTokenizer

from gpt2_max.checkpoint import TOKENIZER_DIR
from gpt2_max.tokenizer import PLAIN_CHAT_TEMPLATE


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
