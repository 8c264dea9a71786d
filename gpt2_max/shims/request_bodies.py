"""OpenAI bodies MAX 26.7's routes answer 500, or answer as if a field were not there,
answered 400 with their cause.

`/v1/completions` turns `prompt` into one request per prompt and then reads the
first request without checking there is one (`"prompt": []`), and refuses a
streamed body of several prompts by raising `NotImplementedError`, which no
handler catches (`max/serve/router/openai_routes.py`, `openai_create_completion`).
A body nested a thousand levels deep fails the routes' own JSON parsing (an uncaught
`RecursionError`), as do a chat's tool call `arguments` so nested, which the chat
route parses again; an integer of more digits than Python's `int` reads there fails
it with a `ValueError`, answered "Value error." (`unreadable`). An integer past int64
(a `seed`, `top_k`, a stop token id) passes the routes' checks and fails later: as
MAX's request queue serializes it, or in the model worker, whose exit stops the
server. All four are the client's mistake, as is a
number that is not finite (JSON's `NaN`, which Python's parser reads), which MAX's
range checks of `top_p` and `min_p` let through to the sampler, and a chat's
`chat_template_kwargs` naming an argument the tokenizer passes itself as it renders
the chat (`RENDERING_ARGUMENTS`), which fails that call ("Invalid JSON.") or replaces
the checkpoint's template with the client's.

Other fields the schema accepts are dropped without a word (`UNSERVED`): `n` and
`best_of` ask for several choices and get one, and `logit_bias` and `suffix` change
nothing (`echo` is answered in full by `echo_answers`); so are penalties and
`min_tokens` on a server started without `--enable-penalties` or
`--enable-min-tokens` (`check_settings`). In a chat,
audio output, web search, the older `functions`, `top_logprobs` without `logprobs`,
and a content part that is not text (an `input_audio` or `file` part) are dropped the
same way (MAX refuses `image_url` and `video_url` parts in its own words; every part
that is not text gets one message here), and a `tool_choice` that requires a call,
from a server that cannot force one (no tool parser, or one that builds no grammar),
is answered in text (`check_tool_choice`). A
client that sent them would take the answer for what it asked.

This module wraps the routes' body parser (`_parse_openai_request_body`, which the
routes look up by name as they run) so such a completions or chat body is refused
there with `InputError`, which the routes answer 400 with its message, as is a body
that is not UTF-8 (a `ValueError`, which the routes answer "Value error."). Every other
body is parsed as before.

Two of MAX's own checks raise `ValueError` with a message that says what is wrong,
and the routes answer every `ValueError` "Value error.": a sampling value out of its
range (`SamplingParams`) and a model name the server does not serve
(`get_pipeline`). The routes' `SamplingParams` is given a
`from_input_and_generation_config`, and their `get_pipeline` a wrapper, that raise the
same check as `InputError`, so the answer is 400 with that message. The wrapper also
answers `/v1/embeddings` 404 on this text generation server (`refuses_embeddings`).
And the routes read `seed` 0 as no seed, so a client's seed 0 sampled differently each
time, a chat's `top_logprobs` 0 beside `logprobs` as no log-probabilities, and a
`response_format` of type "text" as a JSON constraint; all three are carried past
them (`kept`). A chat's `logprobs` without `top_logprobs`, or with
0, then gets each token's log-probability with the one alternative the routes ask
the worker for; OpenAI's and vLLM's answers have none, so each token's alternatives
are cut to the count asked (`ALTERNATIVES`, `alternatives_asked`).

Installed by `shims.install`; it acts in the API process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import reprlib
import sys
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

from fastapi import HTTPException
from max.pipelines.context import SamplingParams, SamplingParamsGenerationConfigDefaults
from max.pipelines.context.exceptions import InputError
from max.pipelines.modeling.types import PipelineTask
from max.pipelines.sampling import ToolCallPolicy
from max.serve.router import openai_routes

UNSERVED = {
    "n": ("this server gives one choice a request", lambda value: value not in (None, 1)),
    "best_of": ("this server gives one choice a request", lambda value: value not in (None, 1)),
    "logit_bias": ("this server applies no logit bias", bool),
    "suffix": ("this server writes no suffix", bool),
    "modalities": ("this server answers in text", lambda value: bool(set(value or ()) - {"text"})),
    "audio": ("this server answers in text, not audio", lambda value: value is not None),
    # A lazy iterator (the schema types it Iterable), which MAX never reads.
    "functions": ("give them as tools (`tools`)",
                  lambda value: value is not None and any(True for _ in value)),
    "function_call": ("give it as `tool_choice`", lambda value: isinstance(value, dict)),
    "web_search_options": ("this server does not search the web",
                           lambda value: value is not None),
}
"""Fields MAX's routes accept and drop: why the answer would not be what was asked, and
whether a value asks for more than the plain answer."""

RENDERING_ARGUMENTS = frozenset({
    "self", "fn", "prompt", "messages", "tools",  # MAX's calls on the way to the renderer
    "conversation", "conversations", "chat_template", "tokenize",  # transformers' renderer
})
"""What the tokenizer passes itself as it renders a chat, beside `chat_template_kwargs`:
the same name there fails a call on the way (answered "Invalid JSON." by the routes),
or, `chat_template` beside a checkpoint's own template, replaces it with the client's."""

INTEGERS = (-(2**63), 2**63 - 1)
"""The integers a request may carry, int64's: past them a field passes the routes'
checks and fails later, as MAX's request queue serializes it (answered 500) or, up to
2**64 - 1, as the model worker puts `top_k` into an int64 buffer (which takes the
server down)."""


def is_int64(value: Any) -> bool:
    """Whether `value` is an integer (not a bool, not a float) within `INTEGERS`."""
    return type(value) is int and INTEGERS[0] <= value <= INTEGERS[1]


def integers(value: Any) -> list[int]:
    """The integers in `value`, an integer or lists of them (token ids); none in others."""
    if isinstance(value, list):
        return [i for item in value for i in integers(item)]
    return [value] if isinstance(value, int) and not isinstance(value, bool) else []


def unreadable(error: Exception, what: str) -> InputError | None:
    """`InputError` naming `what` for JSON that Python's parser cannot read though it is
    well formed (nested past its recursion, or an integer of more digits than `int`
    converts: a `ValueError` the routes answer "Value error."), else None."""
    if isinstance(error, RecursionError):
        return InputError(f"{what} cannot be read: nested too deep.")
    if isinstance(error, ValueError) and "integer string conversion" in str(error):
        return InputError(f"{what} cannot be read: an integer of more than "
                          f"{sys.get_int_max_str_digits()} digits, past the 64-bit integers "
                          "a request can carry.")
    return None


def check_tool_call_arguments(messages: Any) -> None:
    """Raises `InputError` for an assistant message's tool call whose `arguments` the chat
    route's own `json.loads` would fail with other than a `JSONDecodeError` (which it
    answers 400 itself): nested past recursion (a 500) or an integer too long to read."""
    for message in messages or ():
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if not isinstance(arguments, str):
                continue
            try:
                json.loads(arguments)
            except (RecursionError, ValueError) as error:
                if refused := unreadable(
                    error, f"the arguments of tool call {reprlib.repr(call.get('id'))}"
                ):
                    raise refused from None


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> None:
    """Raises `InputError` for `chat_template_kwargs` naming a `RENDERING_ARGUMENTS`."""
    for key in sorted(set(kwargs or ()) & RENDERING_ARGUMENTS):
        raise InputError(f"chat_template_kwargs holds {key!r}, which the server sets itself "
                         "as it renders the chat: give the template's own variables only.")


def check(body: Any) -> None:
    """Raises `InputError` for a completions or chat body MAX's routes would answer 500
    (no prompt, several streamed, an integer past `INTEGERS`) or "Invalid JSON."
    (`RENDERING_ARGUMENTS` in `chat_template_kwargs`), pass on to the sampler
    (a number that is not finite), or answer without a field it sets (`UNSERVED`,
    `top_logprobs` without `logprobs`, `stream_options` without a stream,
    a chat content part that is not text)."""
    for name, value in vars(body).items():
        for number in integers(value):
            if not INTEGERS[0] <= number <= INTEGERS[1]:
                raise InputError(f"{name} holds {number}, past the 64-bit integers a request "
                                 "can carry.")
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{name} is {value}: give a finite number.")
    for name, (why, asks_more) in UNSERVED.items():
        value = getattr(body, name, None)
        if asks_more(value):
            shown = f"={reprlib.repr(value)}" if isinstance(value, str | int | list | dict) else ""
            raise InputError(f"{name}{shown} is not served: {why}.")
    if getattr(body, "top_logprobs", None) is not None and not getattr(body, "logprobs", None):
        raise InputError("top_logprobs is set and logprobs is not: set logprobs to true to "
                         "get log-probabilities.")
    if getattr(body, "stream_options", None) is not None and not getattr(body, "stream", False):
        raise InputError("stream_options is set and stream is not: the options (such as "
                         "include_usage) apply to a stream; set stream to true.")
    for message in getattr(body, "messages", None) or ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") != "text":
                raise InputError(f"a content part of type {reprlib.repr(part.get('type'))} "
                                 "is not served: this server reads text parts only.")
    check_template_kwargs(getattr(body, "chat_template_kwargs", None))
    check_tool_call_arguments(getattr(body, "messages", None))
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list):
        if not prompt:
            raise InputError("prompt is empty: give a string, or a list of token ids or strings.")
        if body.stream and isinstance(prompt[0], str | list) and len(prompt) > 1:
            raise InputError(
                f"stream answers one prompt, and this request has {len(prompt)}: "
                "send each prompt in a request of its own, or leave stream off."
            )


NEUTRAL_PENALTIES = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
"""Each penalty's value that leaves the logits as they are."""


def check_settings(body: Any, sampling: Any) -> None:
    """Raises `InputError` for a completions or chat body that sets a penalty or
    `min_tokens` on a server started without `--enable-penalties` or
    `--enable-min-tokens` (`sampling`, the pipeline's `SamplingConfig`): MAX's model
    worker then samples as if they were not set, with a warning in the server's log
    that the client never sees (`max/pipelines/sampling/sampling_logits_processor.py`).
    So is `min_tokens` or `ignore_eos` beside a JSON `response_format`, which they
    would end."""
    if not sampling.enable_penalties:
        for name, neutral in NEUTRAL_PENALTIES.items():
            value = getattr(body, name, None)
            if value is not None and value != neutral:
                raise InputError(f"{name}={value} is not served: this server was started "
                                 "without --enable-penalties, and would sample without it.")
    if not sampling.enable_min_tokens and (getattr(body, "min_tokens", None) or 0) > 0:
        raise InputError(f"min_tokens={body.min_tokens} is not served: this server was "
                         "started without --enable-min-tokens, and would stop without it.")
    response_format = getattr(body, "response_format", None)
    if not (isinstance(response_format, dict)
            and response_format.get("type") in ("json_schema", "json_object")):
        return
    for name, what in (("min_tokens", "holds back"), ("ignore_eos", "passes over")):
        setting = getattr(body, name, None)
        if setting is True or type(setting) is int and setting > 0:
            raise InputError(
                f"{name}={setting} with a response_format is not served: once the format "
                f"is complete its grammar allows only the end of the text, which {name} "
                f"{what}, and MAX then drops the grammar for the rest of the answer, "
                "which is no longer the format.")


def check_tool_choice(body: Any, unforced: str | None) -> None:
    """Raises `InputError` for a chat body that requires a tool call (`tool_choice`
    "required", a named function or custom tool, or allowed tools in "required" mode)
    from a server that cannot force one (`unforced` says why: `unforced_tool_calls`):
    the answer would be whatever text the model writes, where the client required a
    call."""
    choice = getattr(body, "tool_choice", None)
    required = choice == "required" or isinstance(choice, dict) and (
        choice.get("type") in ("function", "custom")
        or choice.get("type") == "allowed_tools"
        and (choice.get("allowed_tools") or {}).get("mode") == "required"
    )
    if body.tools and required and unforced:
        raise InputError(f"tool_choice={choice!r} is not served: {unforced}, so the model "
                         "would answer in text, not call a tool.")


def unforced_tool_calls(app: Any) -> str | None:
    """Why the chat route cannot make the model call a tool on this server, or None
    where it can. It forces a call only with a grammar, which a tool parser builds
    (`generate_tool_call_grammar`) unless the tool call policy leaves calls
    unconstrained; a parser without one (MAX's `llama`) only reads calls the model
    happens to write."""
    parser = openai_routes.get_tool_parser(app)
    if parser is None:
        return "this server has no tool parser (--tool-parser)"
    if not hasattr(parser, "generate_tool_call_grammar"):
        return (f"this server's tool parser ({type(parser).__name__}) reads calls from the "
                "model's text but builds no grammar that forces one")
    policy = openai_routes.get_app_pipeline_config(app).sampling.tool_call_policy
    if policy is ToolCallPolicy.FORCE_UNCONSTRAINED:
        return f"this server's tool call policy is {policy.value}"
    return None


def kept(body: Any) -> None:
    """`body` set so the routes read three values as the client meant them: `seed` 0
    (`SeedZero`) and a chat's `top_logprobs` 0 beside `logprobs`, which the routes pass
    on as none (no seed, no log-probabilities at all), and a `response_format` of type
    "text", OpenAI's default, which they pass on as a constraint to any JSON value (with
    `--enable-structured-output`; a server with a tool parser and without it stops as
    it builds the constraint). A count of 0 alternatives is asked of the model worker
    as 1 (each token's log-probability comes with its best alternative), since the
    worker reads 0 as none."""
    response_format = getattr(body, "response_format", None)
    if isinstance(response_format, dict) and response_format.get("type") == "text":
        body.response_format = None
    if body.seed == 0:
        body.seed = SeedZero(0)
    if getattr(body, "top_logprobs", None) == 0 and getattr(body, "logprobs", None) is True:
        body.top_logprobs = 1


ALTERNATIVES: ContextVar[int | None] = ContextVar("alternatives_asked", default=None)
"""The alternatives a token's log-probability comes with that this request's chat body
asked for (`top_logprobs`, none if unset), set as the body is parsed, in the request's
own context, which its answer (streamed or not) is built in."""


def alternatives_asked(process: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`process` (the chat routes' `_process_chat_log_probabilities`), each token's
    alternatives cut to the count the request asked for (`ALTERNATIVES`)."""
    @functools.wraps(process)
    def cut(outputs: Any) -> Any:
        logprobs = process(outputs)
        if (asked := ALTERNATIVES.get()) is not None:
            for token in logprobs.content:
                del token.top_logprobs[asked:]
        return logprobs

    return cut


def refusal(error: ValueError) -> InputError:
    """`error` as an `InputError` (answered 400 with its message), the message made
    encodable: one that quotes a client's text (a model name holding a lone surrogate)
    would fail the answer's own encoding, a 500."""
    return InputError(str(error).encode("utf-8", "backslashreplace").decode("utf-8"))


def raises_input_error(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, raising its `ValueError` as `InputError` with the same message."""
    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except ValueError as error:
            raise refusal(error) from None

    return checked


def refuses_embeddings(get_pipeline: Callable[..., Any]) -> Callable[..., Any]:
    """`get_pipeline`, answering the embeddings route 404 where the server does not serve
    an embeddings model, as MAX's audio routes answer for a model that is not an audio
    model. MAX 26.7's embeddings route sends such a request to the text generation
    worker, which generates for it, and then answers 500 as the output is not an
    embedding (or at once, for an empty `input`)."""
    @functools.wraps(get_pipeline)
    def checked(request: Any, model_name: str) -> Any:
        if (request.url.path.endswith("/embeddings") and getattr(request.app.state, "task", None)
                != PipelineTask.EMBEDDINGS_GENERATION):
            raise HTTPException(status_code=404, detail=(
                "This server is not serving an embeddings model, so /v1/embeddings is "
                "unavailable."))
        return get_pipeline(request, model_name)

    return checked


def all_or_none(complete: Callable[..., Any]) -> Callable[..., Any]:
    """`complete` (the completions route's answer to a body's requests, one a prompt),
    each request's context made before any is queued. The route runs them together
    (`asyncio.gather`), so a prompt refused there (a token id outside the vocabulary, a
    prompt past the window) was answered 400 while the body's other prompts, already
    queued, generated to their end for no one. The contexts are made without the
    requests' `stop` strings, as the stop shim makes theirs (`stop_strings`): MAX's
    tokenizer encodes each, and refused one past the window as a prompt too long."""
    @functools.wraps(complete)
    async def checked(self: Any, requests: list[Any]) -> Any:
        if len(requests) > 1:
            for request in requests:
                params = dataclasses.replace(request.sampling_params, stop=None)
                await self.pipeline.tokenizer.new_context(
                    dataclasses.replace(request, sampling_params=params))
        return await complete(self, requests)

    return checked


class SeedZero(int):
    """A client's `seed` 0, true as a truth value (why: `kept`); `CheckedSamplingParams`
    makes it a plain 0 again."""

    def __bool__(self) -> bool:
        return True


GREEDY_BELOW = 1e-5
"""A temperature under which sampling is greedy (vLLM's `_SAMPLING_EPS`): the logits
are divided by the temperature in float32, where 1e-40 overflows every logit (each
step then drew token 0) and 1e-50 is 0 (sampled at temperature 1)."""


def greedy_below(params: SamplingParams) -> SamplingParams:
    """`params`, with a positive temperature below `GREEDY_BELOW` made 0: greedy, as
    MAX makes a temperature of 0 (top-k 1)."""
    if 0 < params.temperature < GREEDY_BELOW:
        return dataclasses.replace(params, temperature=0.0)
    return params


PENALTY_FLOOR = 1e-30
"""The least `repetition_penalty` served. MAX divides a repeated token's positive logit
by it in float32, which past 3.4e38 is infinite: at 1e-39 the draws came from NaN
probabilities (answered 200, `null` log-probabilities). At 1e-30 a logit would have to
pass 3.4e8."""


def check_penalty(params: SamplingParams) -> SamplingParams:
    """`params`, or ValueError for a `repetition_penalty` below `PENALTY_FLOOR`."""
    if params.repetition_penalty < PENALTY_FLOOR:
        raise ValueError(f"repetition_penalty={params.repetition_penalty} is below "
                         f"{PENALTY_FLOOR}: a logit divided by it overflows float32.")
    return params


class ClientStopTokenIds(list):
    """A request's `stop_token_ids` as its client sent them, told apart from the list
    MAX puts there from `generation_config.json` when it sent none: the client's ids
    stop the request even where they name the model's EOS under `ignore_eos`
    (`GPT2TextTokenizer._own_stop_ids`)."""


class ClientMinTokens(int):
    """A request's `min_tokens` as its client sent it, told apart from a
    `min_new_tokens` MAX puts there from `generation_config.json` when it sent none,
    which gives way where the request cannot meet it
    (`GPT2TextTokenizer._fit_min_tokens`)."""


def sampling_defaults(params: Any, defaults: SamplingParamsGenerationConfigDefaults
                      ) -> SamplingParamsGenerationConfigDefaults:
    """A checkpoint's `generation_config.json` defaults as they apply to a request's
    `params`: its `do_sample: false` gives way where the request asks for a temperature
    above 0. MAX turns it into a temperature of 0 and a `top_k` of 1 "unless user
    overrides", and the client's temperature undid only the first, so every sampled
    request came back greedy. vLLM reads no `do_sample`."""
    if defaults.do_sample is False and (params.temperature or 0) > 0:
        return dataclasses.replace(defaults, do_sample=None)
    return defaults


class CheckedSamplingParams(SamplingParams):
    """MAX's `SamplingParams` for the routes, whose one call of it
    (`from_input_and_generation_config`) raises its range checks as `InputError`,
    turns `SeedZero` back into 0, marks the client's `stop_token_ids`
    (`ClientStopTokenIds`) and `min_tokens` (`ClientMinTokens`), refuses a
    `repetition_penalty` below `PENALTY_FLOOR`, samples greedily below
    `GREEDY_BELOW` and lets a client's temperature sample where the checkpoint's
    `do_sample` is false (`sampling_defaults`)."""

    @staticmethod
    @raises_input_error
    def from_input_and_generation_config(
        params: Any, sampling_params_defaults: SamplingParamsGenerationConfigDefaults
    ) -> Any:
        if isinstance(params.seed, SeedZero):
            params = dataclasses.replace(params, seed=0)
        if params.stop_token_ids is not None:
            params = dataclasses.replace(
                params, stop_token_ids=ClientStopTokenIds(params.stop_token_ids))
        if params.min_new_tokens is not None:
            params = dataclasses.replace(
                params, min_new_tokens=ClientMinTokens(params.min_new_tokens))
        return greedy_below(check_penalty(SamplingParams.from_input_and_generation_config(
            params, sampling_defaults(params, sampling_params_defaults))))


def install() -> None:
    """Wraps the routes' body parser with `check`, `check_settings` and `kept` for
    completions and chat bodies, their `SamplingParams` with `raises_input_error`,
    their `get_pipeline` with that and `refuses_embeddings`, their chat
    log-probabilities with `alternatives_asked`, and their answer to several prompts
    with `all_or_none` (once)."""
    original = openai_routes._parse_openai_request_body
    if getattr(original, "checks_bodies", False):
        return
    openai_routes.SamplingParams = CheckedSamplingParams
    openai_routes.get_pipeline = refuses_embeddings(raises_input_error(openai_routes.get_pipeline))
    openai_routes._process_chat_log_probabilities = alternatives_asked(
        openai_routes._process_chat_log_probabilities)
    generator = openai_routes.OpenAICompletionResponseGenerator
    generator.complete = all_or_none(generator.complete)  # type: ignore[method-assign]

    async def parse(request: Any, request_id: str, model_cls: type) -> Any:
        try:
            body = await original(request, request_id, model_cls)
        except UnicodeDecodeError as error:  # a ValueError, which the routes answer unnamed
            raise InputError(f"the request body is not UTF-8: {error.reason} at byte "
                             f"{error.start}.") from None
        except (RecursionError, ValueError) as error:  # the routes' `json.loads`
            if refused := unreadable(error, "the request body"):
                raise refused from None
            raise
        if model_cls in (openai_routes.CreateCompletionRequest,
                         openai_routes.CreateChatCompletionRequest):
            check(body)
            if (config := getattr(request.app.state, "pipeline_config", None)) is not None:
                check_settings(body, config.sampling)
            if model_cls is openai_routes.CreateChatCompletionRequest and body.logprobs:
                ALTERNATIVES.set(body.top_logprobs or 0)  # as asked, before `kept`
            kept(body)
        if model_cls is openai_routes.CreateChatCompletionRequest:
            check_tool_choice(body, unforced_tool_calls(request.app))
        return body

    parse.checks_bodies = True  # type: ignore[attr-defined]
    openai_routes._parse_openai_request_body = parse
