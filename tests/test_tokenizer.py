"""The default chat template GPT-2 is served with, a given one taking precedence, and a
request's stop tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import sys

import pytest
from jinja2 import TemplateSyntaxError
from max.pipelines.context import SamplingParams
from max.pipelines.context.exceptions import InputError
from max.pipelines.lib import PipelineArgs, PipelineConfig
from max.pipelines.modeling.types import (
    RequestID,
    TextGenerationRequest,
    TextGenerationRequestMessage,
)
from transformers import AutoTokenizer

from gpt2_max.shims.internals import openai_response_format
from gpt2_max.shims.request_bodies import ClientMinTokens, ClientStopTokenIds
from gpt2_max.tokenizer import PLAIN_CHAT_TEMPLATE, TOKENIZER_DIR, GPT2TextTokenizer
from gpt2_max.weights.schema import CheckpointError

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


ALTERNATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != loop.index0 is even %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/...') }}"
    "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)
"""A template of the kind fine-tunes ship, refusing a conversation it was not made for."""


@pytest.mark.tier("model")
def test_a_chat_the_template_refuses_is_refused_with_its_reason(checkpoints, max_models, tmp_path):
    """The checkpoint's own template (which MAX lets raise, answered 500), a
    `--chat-template` (which MAX wraps in a ValueError), and a variable of the wrong
    type (a `TypeError`, answered "Invalid JSON."): each an `InputError`, a 400 with
    the reason, and the chat the template takes is rendered."""
    folder = shutil.copytree(checkpoints("default", "hub"), tmp_path / "templated")
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["chat_template"] = ALTERNATE
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    config = max_models(checkpoints("default", "hub")).pipeline_config
    two_users = [TextGenerationRequestMessage(role="user", content=c) for c in ("Hi", "Bye")]
    one_user = two_users[:1]
    for tokenizer in (
        GPT2TextTokenizer(str(folder), config),
        GPT2TextTokenizer(str(checkpoints("default", "hub")), config, chat_template=ALTERNATE),
    ):
        assert tokenizer.apply_chat_template(one_user, None) == "user: Hi\n"
        with pytest.raises(InputError, match="cannot render this chat: Conversation roles must"):
            tokenizer.apply_chat_template(two_users, None)
    plain = GPT2TextTokenizer(str(checkpoints("default", "hub")), config)
    with pytest.raises(InputError, match="cannot render this chat: Documents should be a list"):
        plain.apply_chat_template(one_user, None, documents="x")
    # A template that cannot be read is the server's fault, whatever the chat: not a 400.
    settings["chat_template"] = "{% for m in messages %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(TemplateSyntaxError):
        GPT2TextTokenizer(str(folder), config).apply_chat_template(one_user, None)


def request(**params) -> TextGenerationRequest:
    return TextGenerationRequest(
        request_id=RequestID(), model_name="gpt2", prompt=[15496, 995],
        sampling_params=SamplingParams(**params),
    )


@pytest.mark.tier("model")
def test_own_stop_tokens_stop_a_request_that_ignores_eos(checkpoints, max_models):
    """Under `ignore_eos` a client's stop tokens still stop the request, and the model's
    EOS, which MAX lists among the stop tokens from `generation_config.json` when the
    client sent none, still does not; an id outside the vocabulary is refused."""
    folder = checkpoints("default", "hub")
    tokenizer = GPT2TextTokenizer(str(folder), max_models(folder).pipeline_config)
    (eos,) = tokenizer.eos_token_ids

    def stops(**params) -> set[int]:
        return asyncio.run(tokenizer.new_context(request(**params))).eos_tracker.eos_token_ids

    assert stops(ignore_eos=True, stop_token_ids=[eos]) == set()
    assert stops(ignore_eos=True, stop_token_ids=[eos, 13]) == {13}
    assert stops(stop_token_ids=[eos, 13]) == {eos, 13}
    assert stops(ignore_eos=True) == set()
    with pytest.raises(InputError, match="stop token id 60000 at position 0 is outside"):
        stops(stop_token_ids=[60000])
    # The client's own list (the routes and the Generator mark it) stops at EOS too.
    assert stops(ignore_eos=True, stop_token_ids=ClientStopTokenIds([eos])) == {eos}
    with pytest.raises(InputError, match=f"stop token id {2**64} at position 1 is outside"):
        stops(stop_token_ids=[13, 2**64])


@pytest.mark.tier("model")
def test_min_tokens_hold_back_only_what_a_request_can_be_held_to(checkpoints, max_models):
    """A client's `min_tokens` is kept, and one past the request's room refused; the
    checkpoint's `min_new_tokens` (put there when the client sent none) is cut to the
    room and dropped beside a `response_format`; neither masks anything where no token
    ends the request (`ignore_eos`, no stop ids), where MAX's mask stopped the worker."""
    folder = checkpoints("default", "hub")
    tokenizer = GPT2TextTokenizer(str(folder), max_models(folder).pipeline_config, max_length=64)
    schema = openai_response_format({"type": "json_schema",
                                     "json_schema": {"name": "b", "schema": {"type": "boolean"}}})

    def held(response_format=None, **params) -> int:
        asked = dataclasses.replace(request(**params), response_format=response_format)
        count = asyncio.run(tokenizer.new_context(asked)).min_tokens
        assert type(count) is int  # MAX's queue to the model worker recursed on the mark
        return count

    assert held(min_new_tokens=ClientMinTokens(5), max_new_tokens=9) == 5
    assert held(min_new_tokens=ClientMinTokens(0)) == 0
    with pytest.raises(InputError, match=r"min_tokens \(5\) \+ prompt_len \(2\)"):
        held(min_new_tokens=ClientMinTokens(5), max_new_tokens=4)
    assert held(min_new_tokens=5, max_new_tokens=9) == 5
    assert held(min_new_tokens=5, max_new_tokens=4) == 4
    assert held(min_new_tokens=500) == 62  # the window's 64, less the prompt
    assert held(schema, min_new_tokens=5, max_new_tokens=9) == 0
    for count in (5, ClientMinTokens(5)):
        assert held(min_new_tokens=count, max_new_tokens=9, ignore_eos=True) == 0
        assert held(min_new_tokens=count, max_new_tokens=9, ignore_eos=True,
                    stop_token_ids=ClientStopTokenIds([13])) == 5


@pytest.mark.tier("unit")
@pytest.mark.parametrize("defaults, why", [
    ({"do_sample": True, "temperature": -1.0}, r"temperature must be in \[0.0, 2.0\], was -1.0"),
    ({"top_p": 2.0}, r"top_p must be in \[0.0, 1.0\], was 2.0"),
    ({"temperature": "hot"}, r"\(temperature='hot'\).*must be real number"),
    ({"min_new_tokens": 64}, r"min_new_tokens \(64\) leaves no room for a prompt in the "
                             r"window of 64 tokens"),
    ({"repetition_penalty": 1e-39}, r"repetition_penalty=1e-39 is below 1e-30"),
    # Counts and ids MAX's queue to the model worker refused, which stopped it.
    ({"min_new_tokens": 2.0}, r"min_new_tokens must be a 64-bit integer, was 2.0"),
    ({"max_new_tokens": 2**64}, rf"max_new_tokens must be a 64-bit integer, was {2**64}"),
    ({"eos_token_id": [50256, "x"]}, r"eos_token_id must be a 64-bit integer, was 'x'"),
    ({"eos_token_id": 50256.0}, r"eos_token_id must be a 64-bit integer, was 50256.0"),
    ({"do_sample": False, "repetition_penalty": 1.3, "min_new_tokens": 63}, None),
])
def test_sampling_defaults_max_would_refuse_in_every_request_are_refused_at_load(
    gpt2_max_checkpoint, tmp_path, defaults, why
):
    """MAX puts `generation_config.json`'s sampling defaults into every request that
    leaves them unset and checks them there: each such request was answered 400 for
    a value the client never sent. Defaults MAX takes still load."""
    folder = shutil.copytree(gpt2_max_checkpoint, tmp_path / "defaults")
    (folder / "generation_config.json").write_text(json.dumps(defaults))
    config = PipelineConfig.from_args(PipelineArgs.from_flat_kwargs(
        model_path=str(folder), custom_architectures=["gpt2_max"], device_specs="cpu"))

    def load() -> GPT2TextTokenizer:
        return GPT2TextTokenizer(str(folder), config, max_length=64)

    if why is None:
        assert load().max_length == 64
        return
    with pytest.raises(CheckpointError, match=f"generation_config.json sets sampling "
                                              f"defaults .*{why}"):
        load()


@pytest.mark.tier("unit")
@pytest.mark.parametrize("text", [
    json.dumps({"do_sample": False, "eos_token_id": [50256, 8539], "num_return_sequences": 2}),
    '{"eos_token_id": 8539,}',
])
def test_a_generation_config_transformers_cannot_read_is_refused_at_load(
    gpt2_max_checkpoint, tmp_path, text
):
    """MAX drops a `generation_config.json` transformers refuses, with its end-of-text
    ids, and logs it only at debug: the server ran past the file's EOS."""
    folder = shutil.copytree(gpt2_max_checkpoint, tmp_path / "unread")
    (folder / "generation_config.json").write_text(text)
    config = PipelineConfig.from_args(PipelineArgs.from_flat_kwargs(
        model_path=str(folder), custom_architectures=["gpt2_max"], device_specs="cpu"))
    with pytest.raises(CheckpointError, match=r"generation_config.json cannot be read \("):
        GPT2TextTokenizer(str(folder), config, max_length=64)


@pytest.mark.tier("unit")
def test_a_dkv_cache_hint_nested_too_deep_is_refused(gpt2_max_checkpoint):
    """MAX re-serializes a request's `dkv_cache_hint` (`json.dumps`) deeper in the stack
    than the body parser reads it, so a hint nested just under the parser's refusal
    raised `RecursionError` there: a 500."""
    config = PipelineConfig.from_args(PipelineArgs.from_flat_kwargs(
        model_path=str(gpt2_max_checkpoint), custom_architectures=["gpt2_max"],
        device_specs="cpu"))
    tokenizer = GPT2TextTokenizer(str(gpt2_max_checkpoint), config, max_length=64)
    hint: dict = {"v": 1}
    for _ in range(sys.getrecursionlimit()):
        hint = {"a": hint}
    deep = dataclasses.replace(request(), dkv_cache_hint=hint)
    with pytest.raises(InputError, match="the request cannot be read: nested too deep"):
        asyncio.run(tokenizer.new_context(deep))
    assert asyncio.run(tokenizer.new_context(request())).tokens.prompt_length == 2
