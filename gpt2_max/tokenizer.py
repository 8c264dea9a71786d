"""GPT-2's tokenizer, with a chat template so `/v1/chat/completions` works.

GPT-2 was never trained on chats and ships no chat template; MAX answers a chat
request to such a model with 400. `PLAIN_CHAT_TEMPLATE` renders a conversation
as plain `Role: content` lines ending in `Assistant:`, which a base model can
continue. It is used only for chat requests: completions and `max generate`
still see a template-less tokenizer and send the raw prompt. A template in the
checkpoint or `--chat-template` takes precedence.
"""

from __future__ import annotations

from typing import Any

from max.pipelines.lib import TextTokenizer
from max.pipelines.modeling.types import (
    TextGenerationRequestMessage,
    TextGenerationRequestTool,
)
from transformers import PreTrainedTokenizerBase

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class GPT2Tokenizer(TextTokenizer):
    """`TextTokenizer` that renders chats with `PLAIN_CHAT_TEMPLATE` when it has none."""

    def apply_chat_template(
        self,
        messages: list[TextGenerationRequestMessage],
        tools: list[TextGenerationRequestTool] | None,
        **chat_template_options: Any,
    ) -> str:
        if self._custom_template_provided or self.delegate.chat_template:
            return super().apply_chat_template(messages, tools, **chat_template_options)
        return PreTrainedTokenizerBase.apply_chat_template(
            self.delegate,
            [message.flatten_content() for message in messages],
            chat_template=PLAIN_CHAT_TEMPLATE,
            tokenize=False,
            tools=tools,
            **{"add_generation_prompt": True, **chat_template_options},
        )
