"""What `shims.fast_forward` leans on in MAX 26.7's serving loop, with MAX's own objects.

No graph is compiled: the step is MAX's `update_context_and_prepare_responses`
applied to a context whose matcher MAX's xgrammar backend built, as the
worker does. A test that fails names the MAX behaviour that moved.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
from max.pipelines.context import GenerationStatus, SamplingParams, TextContext, TokenBuffer
from max.pipelines.lib.pipeline_variants.utils import update_context_and_prepare_responses
from max.pipelines.modeling.types import msgpack_numpy_decoder, msgpack_numpy_encoder
from transformers import AutoTokenizer

from gpt2_max.shims.fast_forward import FastForwardContext, only_allowed_token
from gpt2_max.testing.reference import server_grammar_backend
from gpt2_max.tokenizer import TOKENIZER_DIR

pytestmark = pytest.mark.tier("unit")

SCHEMA = {"const": "ok"}
"""Answered `"ok"`: after its closing quote only the end-of-text token is allowed."""
TOKENIZER = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
EOS = TOKENIZER.eos_token_id


@pytest.fixture(scope="module")
def backend():
    return server_grammar_backend()


def context(backend, cls=FastForwardContext, max_length: int = 64, **options) -> TextContext:
    ctx = cls(max_length=max_length, tokens=TokenBuffer(np.arange(3)), vocab_size=len(TOKENIZER),
              json_schema=json.dumps(SCHEMA), **options)
    ctx.eos_tracker.eos_token_ids = {EOS}
    ctx.grammar_enforced = True  # as MAX's tokenizer sets it for a `response_format`
    ctx.set_matcher(backend.create_matcher(backend.compile_json_schema(ctx.json_schema)))
    return ctx


def step(ctx: TextContext, token: int) -> list[int]:
    """One step of MAX's loop that sampled `token`; the tokens it returns to the client."""
    outputs = update_context_and_prepare_responses(np.array([[token]], np.int32), [ctx])
    return outputs[ctx.request_id].tokens if ctx.request_id in outputs else []


def test_the_worker_decodes_a_request_as_the_architectures_context_type() -> None:
    """`api_server.py:168`: the request queue is typed by `context_type`, so a
    `TextContext` the API process built arrives as `FastForwardContext`."""
    sent = TextContext(max_length=8, tokens=TokenBuffer(np.arange(3)), json_schema="{}")
    received = msgpack_numpy_decoder(FastForwardContext)(msgpack_numpy_encoder()(sent))
    assert type(received) is FastForwardContext
    assert received.tokens.all.tolist() == [0, 1, 2] and received.json_schema == "{}"


def test_a_step_then_fast_forwards_the_only_allowed_tokens(backend) -> None:
    """After `"ok` only the closing quote is allowed, then only the end-of-text
    token: both are appended in the step that sampled `ok`, returned with it,
    and the request ends, where MAX's loop takes two more steps."""
    quote, ok = TOKENIZER.encode('"ok"')[:2]
    ctx, plain = context(backend), context(backend, cls=TextContext)
    assert step(ctx, quote) == step(plain, quote) == [quote]
    assert only_allowed_token(ctx.matcher, len(TOKENIZER)) is None  # `o`, `ok`, ...
    assert step(ctx, ok) == [ok, quote, EOS]
    assert ctx.status == GenerationStatus.END_OF_SEQUENCE
    assert [step(plain, ok), step(plain, quote), step(plain, EOS)] == [[ok], [quote], [EOS]]
    assert plain.status == GenerationStatus.END_OF_SEQUENCE
    assert ctx.tokens.generated.tolist() == plain.tokens.generated.tolist()


def test_forced_tokens_run_in_the_next_step_with_the_sampled_one(backend) -> None:
    """`run_again`: the sampled token and the forced ones are the next step's input,
    so the scheduler's `alloc` and token budget (which count `active_length`) see them."""
    quote, ok = TOKENIZER.encode('"ok"')[:2]
    ctx = context(backend)
    step(ctx, quote)
    assert ctx.tokens.active_length == 1
    step(ctx, ok)
    assert ctx.tokens.active.tolist() == [ok, quote, EOS]
    assert ctx.tokens.processed_length == 3 + 1


def test_max_tokens_stops_the_fast_forward(backend) -> None:
    quote, ok = TOKENIZER.encode('"ok"')[:2]
    ctx = context(backend, max_length=3 + 3)
    step(ctx, quote)
    assert step(ctx, ok) == [ok, quote]
    assert ctx.status == GenerationStatus.MAXIMUM_LENGTH


def test_end_of_text_is_not_forced_before_min_tokens(backend) -> None:
    quote, ok = TOKENIZER.encode('"ok"')[:2]
    ctx = context(backend, sampling_params=SamplingParams(min_new_tokens=4))
    step(ctx, quote)
    assert step(ctx, ok) == [ok, quote]
    assert not ctx.is_done


def test_log_probability_requests_are_not_fast_forwarded(backend) -> None:
    quote, ok = TOKENIZER.encode('"ok"')[:2]
    ctx = context(backend, log_probabilities=1)
    step(ctx, quote)
    assert step(ctx, ok) == [ok]


def test_maxs_step_updates_the_context_before_it_returns_outputs() -> None:
    """`utils.py:170-177`: buffer, then matcher, then the client's tokens."""
    source = inspect.getsource(update_context_and_prepare_responses)
    order = [source.index(call) for call in (
        "context.advance_token_buffer(", "context.advance_fsm(next_token)",
        "context.to_generation_output()",
    )]
    assert order == sorted(order)


def test_the_architecture_keeps_maxs_overlap_scheduler_off() -> None:
    """With overlap, `utils.py:162-168` realizes a placeholder instead of calling
    `advance_fsm` before the outputs, and the next step is already built."""
    from gpt2_max.arch import gpt2_arch

    assert gpt2_arch.supports_overlap_scheduler is False
