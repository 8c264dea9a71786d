"""`BurstContext` and the rules that decide how far a burst may run a row."""

from __future__ import annotations

import numpy as np
import pytest
from max.pipelines.context import TextContext, TokenBuffer
from max.pipelines.context.eos_tracking import EOSTracker
from max.pipelines.context.status import GenerationStatus
from max.pipelines.lib.pipeline_variants.utils import update_context_and_prepare_responses
from max.pipelines.modeling.types import msgpack_numpy_decoder, msgpack_numpy_encoder

from gpt2_max.bursts import BurstContext, FastForwardBurstContext, decode_steps
from gpt2_max.bursts.context import extra_steps
from gpt2_max.bursts.model import ENV
from gpt2_max.settings import CPU_DECODE_STEPS, settings

pytestmark = pytest.mark.tier("unit")

PAGE = 128
EOS = 50256


def decoding(prompt_length: int, *, cls: type = BurstContext, max_length: int = 1024,
             **fields) -> TextContext:
    """A context past its prefill: the prompt processed, one sampled token active."""
    context = cls(max_length=max_length, tokens=TokenBuffer(np.arange(prompt_length) + 100),
                  eos_tracker=EOSTracker(eos_token_ids={EOS}), **fields)
    context.update(7)
    return context


def test_a_burst_runs_to_the_end_of_the_rows_last_page():
    # 125 prompt tokens and one new: the page holds two more.
    assert extra_steps(decoding(125), PAGE) == 2
    assert extra_steps(decoding(127), PAGE) == 0
    assert extra_steps(decoding(10), PAGE) == PAGE - 11


def test_a_burst_stops_short_of_the_window():
    assert extra_steps(decoding(10, max_length=15), PAGE) == 3


@pytest.mark.parametrize("fields", [
    dict(log_probabilities=2), dict(log_probabilities_echo=True),
    dict(json_schema="{}"), dict(grammar="root ::= \"a\""),
])
def test_rows_that_need_maxs_loop_each_token_get_no_burst(fields):
    assert extra_steps(decoding(10, **fields), PAGE) == 0


def test_prefills_and_plain_contexts_get_no_burst():
    prefill = BurstContext(max_length=1024, tokens=TokenBuffer(np.arange(10)))
    assert extra_steps(prefill, PAGE) == 0
    assert extra_steps(decoding(10, cls=TextContext), PAGE) == 0


def test_the_burst_joins_the_token_max_committed():
    context = decoding(10)
    context.expect_burst([11, 12, 13])
    context.update(11)
    assert list(context.tokens.generated) == [7, 11, 12, 13]
    # The KV of 11 and 12 was written by the burst; 13 is the next step's input.
    assert context.tokens.processed_length == 13
    assert list(context.tokens.active) == [13]
    assert context.to_generation_output().tokens == [7, 11, 12, 13]


def test_a_token_max_sampled_otherwise_drops_the_burst_for_good():
    context = decoding(10)
    context.expect_burst([11, 12, 13])
    context.update(99)
    assert list(context.tokens.generated) == [7, 99]
    assert context.bursts_off
    assert extra_steps(context, PAGE) == 0
    assert not BurstContext.bursts_off  # the class's default is untouched


def test_the_burst_ends_at_end_of_text_and_at_the_length_limit():
    context = decoding(10)
    context.expect_burst([11, EOS, 13])
    context.update(11)
    assert list(context.tokens.generated) == [7, 11, EOS]
    assert context.status == GenerationStatus.END_OF_SEQUENCE

    context = decoding(10, max_length=13)
    context.expect_burst([11, 12, 13, 14])
    context.update(11)
    assert list(context.tokens.generated) == [7, 11, 12]
    assert context.status == GenerationStatus.MAXIMUM_LENGTH


def test_a_burst_is_used_once():
    context = decoding(10)
    context.expect_burst([11, 12])
    context.update(11)
    context.update(20)
    assert list(context.tokens.generated) == [7, 11, 12, 20]


def test_decode_steps_default_to_bursts_on_the_cpu_only(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert decode_steps(on_host=True) == CPU_DECODE_STEPS > 1
    assert decode_steps(on_host=False) == 1
    monkeypatch.setenv(ENV, "4")
    settings.cache_clear()
    assert decode_steps(on_host=False) == decode_steps(on_host=True) == 4


@pytest.mark.parametrize("cls", [BurstContext, FastForwardBurstContext])
def test_the_worker_decodes_a_request_as_the_context_type(cls):
    """The API process sends a `TextContext`; MAX's worker decodes it as the
    architecture's context type, with no burst pending and bursts on."""
    sent = decoding(10, cls=TextContext)
    received = msgpack_numpy_decoder(cls)(msgpack_numpy_encoder()(sent))
    assert type(received) is cls
    assert list(received.tokens.all) == list(sent.tokens.all)
    assert extra_steps(received, PAGE) == PAGE - 11


def test_maxs_step_update_hands_the_burst_over_in_one_output():
    """MAX's own post-step function (`update_context_and_prepare_responses`) commits
    its token, the context appends the burst, and one output carries them all."""
    contexts = [decoding(10), decoding(20)]
    contexts[0].expect_burst([11, 12, 13])
    contexts[1].expect_burst([21, 22, 23])
    outputs = update_context_and_prepare_responses(np.array([[11], [99]]), contexts)
    assert outputs[contexts[0].request_id].tokens == [7, 11, 12, 13]
    assert outputs[contexts[1].request_id].tokens == [7, 99]
