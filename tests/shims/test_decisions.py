"""`shims.decisions`: MAX 26.7's scoring routes turn a tiny temperature into NaN and
pass any `chat_template_kwargs` to the renderer (the behaviours the shim leans on,
checked so a release that mends them is noticed); with the shim, the probabilities
are MAX's wherever those are finite, and the renderer's own arguments are refused.

The routes served, against transformers, are tested in `tests/test_serve_decisions.py`.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from max.pipelines.context.exceptions import InputError
from max.serve.router import _chat_format, _decider_format, _decisions_prompt

from gpt2_max.shims import decisions, request_bodies

pytestmark = pytest.mark.tier("unit")

MAX_SOFTMAX = _decisions_prompt.option_probabilities
LOG_PROBABILITIES = [-9.5, -11.25, -9.75, -30.0]


def test_maxs_softmax_is_nan_at_a_temperature_that_overflows():
    assert all(math.isnan(p) for p in MAX_SOFTMAX(LOG_PROBABILITIES, 5e-324))


@pytest.mark.parametrize("temperature", [1e-300, 1e-3, 0.3, 1.0, 7.0, 1e300])
def test_every_finite_answer_is_maxs(temperature):
    shifted = decisions.from_the_top(MAX_SOFTMAX)(LOG_PROBABILITIES, temperature)
    assert shifted == MAX_SOFTMAX(LOG_PROBABILITIES, temperature)


@pytest.mark.parametrize("temperature", [5e-324, 1e-310])
def test_a_temperature_too_small_to_divide_by_gives_the_top_label_everything(temperature):
    shifted = decisions.from_the_top(MAX_SOFTMAX)(LOG_PROBABILITIES, temperature)
    assert shifted == [1.0, 0.0, 0.0, 0.0]


def test_install_wraps_each_format_once():
    decisions.install()
    decisions.install()
    for module in (_chat_format, _decider_format):
        assert module.option_probabilities.__wrapped__ is MAX_SOFTMAX
    encode = _chat_format.ChatFormat.encode
    assert encode.checks_template_kwargs and not hasattr(encode.__wrapped__, "__wrapped__")


@pytest.mark.parametrize("key", sorted(request_bodies.RENDERING_ARGUMENTS))
def test_the_renderers_own_arguments_are_refused_before_it_runs(key):
    calls = []

    async def encode(self, tokenizer, state, items, chat_template_kwargs):
        calls.append(chat_template_kwargs)
        return []

    checked = decisions.checks_template_kwargs(encode)
    with pytest.raises(InputError, match=f"chat_template_kwargs holds '{key}', which the "):
        asyncio.run(checked(None, None, "state", [], {key: 1, "x": 2}))
    assert calls == []
    assert asyncio.run(checked(None, None, "state", [], {"x": 2})) == []
    assert calls == [{"x": 2}]


def test_maxs_chat_format_hands_the_renderer_its_own_arguments_twice():
    """Without the shim's check: `tools` meets the renderer's own (a 500)."""
    decisions.install()

    class Renderer:
        def apply_chat_template(self, messages, tools=None, **options):
            return "rendered"

    view = _decisions_prompt.QuestionView(
        kind="yes_no", question="Is it?", names=["yes", "no"], details=[None, None])
    encode = _chat_format.ChatFormat.encode.__wrapped__
    with pytest.raises(TypeError, match="multiple values for keyword argument 'tools'"):
        asyncio.run(encode(_chat_format.ChatFormat(), Renderer(), "x", [("q", view)],
                           {"tools": []}))
