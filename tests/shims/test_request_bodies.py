"""`request_bodies`: the bodies MAX 26.7 answers 500 or answers without a field they set,
and the sampling values it answers "Value error.", refused by name."""

import asyncio
import dataclasses
import inspect
import json
from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from max.pipelines.context import SamplingParams, SamplingParamsInput
from max.pipelines.context.exceptions import InputError
from max.pipelines.context.sampling_params import SamplingParamsGenerationConfigDefaults
from max.pipelines.modeling.types import PipelineTask
from max.pipelines.sampling import ToolCallPolicy
from max.serve.parser.llama_tool_parser import LlamaToolParser
from max.serve.router import openai_routes

from gpt2_max.shims import request_bodies

pytestmark = pytest.mark.tier("unit")


def body(prompt="Hi", stream=False, **fields):
    return SimpleNamespace(prompt=prompt, stream=stream, **fields)


@pytest.mark.parametrize(
    "prompt, stream, fields, message",
    [
        ([], False, {}, "prompt is empty"),
        ([], True, {}, "prompt is empty"),
        ([[1], [2]], True, {}, "this request has 2"),
        (["a", "b", "c"], True, {}, "this request has 3"),
        ("Hi", False, dict(n=2), "n=2 is not served: this server gives one choice"),
        ("Hi", True, dict(n=0), "n=0 is not served"),
        ("Hi", False, dict(best_of=3), "best_of=3 is not served"),
        ("Hi", False, dict(logit_bias={"13": 5}), "logit_bias={'13': 5} is not served"),
        ("Hi", False, dict(suffix="end"), "suffix='end' is not served"),
        ("Hi", False, dict(seed=2**64), "seed holds 18446744073709551616, past the 64-bit"),
        ("Hi", False, dict(top_k=2**63), "top_k holds 9223372036854775808"),
        ("Hi", False, dict(top_p=float("nan")), "top_p is nan: give a finite number"),
        ("Hi", False, dict(min_p=float("-inf")), "min_p is -inf"),
        ("Hi", False, dict(seed=-(2**63) - 1), "seed holds -9223372036854775809"),
        ("Hi", False, dict(stop_token_ids=[5, 2**70]), "stop_token_ids holds 1180591620"),
        ([[1, 2], [3, 2**64]], False, {}, "prompt holds 18446744073709551616"),
        ("Hi", False, dict(modalities=["audio"]), r"modalities=\['audio'\] is not served"),
        ("Hi", False, dict(audio={"voice": "alloy"}), "audio={'voice': 'alloy'} is not served"),
        ("Hi", False, dict(function_call={"name": "f"}), "function_call={'name': 'f'} is not"),
        ("Hi", False, dict(functions=iter([{"name": "f"}])), "functions is not served"),
        ("Hi", False, dict(web_search_options={}), "does not search the web"),
        ("Hi", False, dict(logprobs=False, top_logprobs=0), "top_logprobs is set and logprobs"),
        ("Hi", False, dict(stream_options={"include_usage": True}), "stream_options is set and"),
        ("Hi", False, dict(logit_bias={str(i): 1 for i in range(1000)}), r"\.\.\.\} is not"),
    ],
)
def test_bodies_the_routes_answer_wrongly_are_refused_naming_the_cause(
    prompt, stream, fields, message
):
    with pytest.raises(InputError, match=message):
        request_bodies.check(body(prompt, stream, **fields))


@pytest.mark.parametrize(
    "prompt, stream, fields",
    [
        ("", False, {}), ("Hi", True, {}), ([15496, 995], True, {}), ([[1], [2]], False, {}),
        (["a"], True, {}), ("Hi", False, dict(n=1, best_of=1, logit_bias={}, suffix="")),
        ("Hi", False, dict(n=None, best_of=None, logit_bias=None, suffix=None, echo=None)),
        ("Hi", False, dict(echo=True, logprobs=1)), ("Hi", False, dict(echo=False)),
        ("Hi", False, dict(echo=True)),
        ("Hi", False, dict(seed=2**63 - 1, top_k=-(2**63), stop_token_ids=[2**62], user="x")),
        ("Hi", False, dict(functions=iter([]), function_call="auto")),
        ("Hi", False, dict(modalities=["text"], audio=None, functions=None, function_call=None,
                           web_search_options=None, logprobs=True, top_logprobs=3)),
        ("Hi", False, dict(modalities=None, logprobs=None, top_logprobs=None)),
        ("Hi", True, dict(stream_options={"include_usage": True})),
        ("Hi", False, dict(stream_options=None)),
    ],
)
def test_other_bodies_pass(prompt, stream, fields):
    request_bodies.check(body(prompt, stream, **fields))


def sampling(penalties=False, min_tokens=False):
    return SimpleNamespace(enable_penalties=penalties, enable_min_tokens=min_tokens)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(presence_penalty=1.5), "presence_penalty=1.5 is not served: .* --enable-penalties"),
        (dict(frequency_penalty=-0.5), "frequency_penalty=-0.5 is not served"),
        (dict(repetition_penalty=1.2), "repetition_penalty=1.2 is not served"),
        (dict(min_tokens=3), "min_tokens=3 is not served: .* --enable-min-tokens"),
    ],
)
def test_what_the_server_was_not_started_for_is_refused_naming_the_flag(fields, message):
    with pytest.raises(InputError, match=message):
        request_bodies.check_settings(body(**fields), sampling())
    request_bodies.check_settings(body(**fields), sampling(penalties=True, min_tokens=True))


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
@pytest.mark.parametrize("name, value", [("min_tokens", 10), ("ignore_eos", True)])
def test_min_tokens_or_ignore_eos_beside_a_json_response_format_is_refused(kind, name, value):
    """Once the format is complete its grammar allows only EOS, which `min_tokens` masks
    and `ignore_eos` passes: MAX then dropped the grammar (`{"type": "boolean"}`,
    `min_tokens` 10 answered `false!` and free text; `ignore_eos` answered
    `truepartialhtt wing ceremonies`)."""
    started = sampling(min_tokens=True)
    with pytest.raises(InputError, match=f"{name}={value} with a response_format is not"):
        request_bodies.check_settings(body(**{name: value}, response_format={"type": kind}),
                                      started)
    request_bodies.check_settings(body(**{name: value}, response_format={"type": "text"}),
                                  started)
    request_bodies.check_settings(body(min_tokens=0, ignore_eos=False,
                                       response_format={"type": kind}), started)


def test_a_checkpoints_greedy_default_gives_way_to_a_clients_temperature():
    """`do_sample: false` in `generation_config.json`: MAX made it temperature 0 and
    top_k 1, and a client's temperature undid only the first, so a sampled request came
    back greedy. A request that leaves the temperature unset, or sets 0, stays greedy."""
    greedy = SamplingParamsGenerationConfigDefaults(do_sample=False, top_p=0.9)
    sampled = request_bodies.CheckedSamplingParams.from_input_and_generation_config(
        SamplingParamsInput(temperature=1.0), sampling_params_defaults=greedy)
    assert (sampled.temperature, sampled.top_k, sampled.top_p) == (1.0, -1, 0.9)
    for unset in (SamplingParamsInput(), SamplingParamsInput(temperature=0.0)):
        params = request_bodies.CheckedSamplingParams.from_input_and_generation_config(
            unset, sampling_params_defaults=greedy)
        assert (params.temperature, params.top_k) == (0, 1)


def test_a_64_bit_integer_is_an_int_within_int64():
    assert request_bodies.is_int64(2**63 - 1) and request_bodies.is_int64(-(2**63))
    for value in (2**63, 2.0, True, "2", None):
        assert not request_bodies.is_int64(value)


def test_neutral_penalties_and_no_min_tokens_pass_any_server():
    neutral = body(presence_penalty=0.0, frequency_penalty=0, repetition_penalty=1.0,
                   min_tokens=0)
    request_bodies.check_settings(neutral, sampling())
    request_bodies.check_settings(body(presence_penalty=None, min_tokens=None), sampling())
    request_bodies.check_settings(SimpleNamespace(messages=[]), sampling())


@pytest.mark.parametrize("key", sorted(request_bodies.RENDERING_ARGUMENTS))
def test_chat_template_kwargs_naming_what_the_renderer_sets_are_refused(key):
    with pytest.raises(InputError, match=f"chat_template_kwargs holds '{key}', which the "):
        request_bodies.check(SimpleNamespace(messages=[], stream=False,
                                             chat_template_kwargs={key: True, "x": 1}))


def test_a_templates_own_variables_pass():
    for kwargs in (None, {}, {"add_generation_prompt": False, "documents": [], "x": 1}):
        request_bodies.check(SimpleNamespace(messages=[], stream=False,
                                             chat_template_kwargs=kwargs))


def test_a_chat_body_without_a_prompt_is_checked_by_its_fields():
    request_bodies.check(SimpleNamespace(messages=[], n=1, stream=False))
    with pytest.raises(InputError, match="n=3"):
        request_bodies.check(SimpleNamespace(messages=[], n=3, stream=False))


def chat(*contents):
    return SimpleNamespace(messages=[{"role": "user", "content": c} for c in contents],
                           stream=False)


@pytest.mark.parametrize("part_type", ["input_audio", "file", "image_url", "refusal", None])
def test_a_chat_content_part_that_is_not_text_is_refused_by_its_type(part_type):
    with pytest.raises(InputError, match=f"a content part of type {part_type!r} is not served"):
        request_bodies.check(chat("Hi", [{"type": "text", "text": "a"}, {"type": part_type}]))


def test_chat_contents_of_text_pass_and_others_are_left_to_the_route():
    request_bodies.check(chat("Hi", None, [], [{"type": "text", "text": "a"}], 5, ["not a part"]))
    request_bodies.check(SimpleNamespace(messages=["not a message"], stream=False))


def test_the_embeddings_route_of_a_text_server_is_404():
    request_bodies.install()

    def request(path, task):
        pipeline = SimpleNamespace(model_name="gpt2", lora_queue=None,
                                   tokenizer=SimpleNamespace())
        return SimpleNamespace(url=SimpleNamespace(path=path), app=SimpleNamespace(
            state=SimpleNamespace(pipeline=pipeline, task=task)))

    with pytest.raises(HTTPException) as raised:
        openai_routes.get_pipeline(request("/v1/embeddings", PipelineTask.TEXT_GENERATION), "")
    assert raised.value.status_code == 404
    assert "not serving an embeddings model" in raised.value.detail
    with pytest.raises(InputError, match="Unknown model"):  # past the route check, MAX's own
        openai_routes.get_pipeline(
            request("/v1/embeddings", PipelineTask.EMBEDDINGS_GENERATION), "gpt-4")


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "f"}},
    {"type": "custom", "custom": {"name": "f"}},
    {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}},
])
def test_a_required_tool_call_needs_a_server_that_forces_one(choice):
    body = SimpleNamespace(tools=TOOLS, tool_choice=choice)
    with pytest.raises(InputError, match="is not served: why not, so the model would answer"):
        request_bodies.check_tool_choice(body, "why not")
    request_bodies.check_tool_choice(body, None)


class GrammarParser:
    def generate_tool_call_grammar(self, **kwargs):
        return ""


@pytest.mark.parametrize("parser, policy, why", [
    (None, "default_strict_false_and_best_effort", "this server has no tool parser"),
    (LlamaToolParser(), "default_strict_false_and_best_effort",
     "tool parser (LlamaToolParser) reads calls from the model's text but builds no grammar"),
    (GrammarParser(), "force_unconstrained", "tool call policy is force_unconstrained"),
    (GrammarParser(), "default_strict_false_and_best_effort", None),
])
def test_a_server_forces_a_call_only_with_a_parsers_grammar(monkeypatch, parser, policy, why):
    """As MAX's chat route builds one (`has_grammar_parser`): without it a required
    call is whatever text the model writes (MAX's `llama` parser: text, finish_reason
    "length")."""
    config = SimpleNamespace(sampling=SimpleNamespace(tool_call_policy=ToolCallPolicy(policy)))
    monkeypatch.setattr(openai_routes, "get_tool_parser", lambda app: parser)
    monkeypatch.setattr(openai_routes, "get_app_pipeline_config", lambda app: config)
    unforced = request_bodies.unforced_tool_calls(object())
    assert unforced == why if why is None else why in unforced


@pytest.mark.parametrize("tools, choice", [
    (TOOLS, None), (TOOLS, "auto"), (TOOLS, "none"), (None, "required"), ([], "required"),
    (TOOLS, {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}),
])
def test_a_tool_call_not_required_passes(tools, choice):
    request_bodies.check_tool_choice(SimpleNamespace(tools=tools, tool_choice=choice), "why")


def test_the_routes_sampling_values_out_of_range_say_which():
    request_bodies.install()
    make = openai_routes.SamplingParams.from_input_and_generation_config
    defaults = SamplingParamsGenerationConfigDefaults()
    made = make(SamplingParamsInput(temperature=0.5), sampling_params_defaults=defaults)
    assert type(made) is SamplingParams and made.temperature == 0.5
    assert issubclass(openai_routes.SamplingParams, SamplingParams)
    with pytest.raises(InputError, match=r"temperature must be in \[0.0, 2.0\], was 5"):
        make(SamplingParamsInput(temperature=5.0), sampling_params_defaults=defaults)


def tool_call(arguments):
    return {"role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "f", "arguments": arguments}}]}


@pytest.mark.parametrize("arguments, message", [
    ("[" * 5000, "the arguments of tool call 'c1' cannot be read: nested too deep"),
    ('{"a": ' + "7" * 5000 + "}", "cannot be read: an integer of more than 4300 digits"),
])
def test_tool_call_arguments_the_chat_route_cannot_read_are_refused(arguments, message):
    """The route's `json.loads` of them raises `RecursionError` (answered 500) or a
    `ValueError` that is not a `JSONDecodeError` (answered "Value error.")."""
    with pytest.raises((RecursionError, ValueError)) as raised:
        openai_routes._validate_tool_message_consistency([tool_call(arguments)])
    assert not isinstance(raised.value, json.JSONDecodeError | InputError)
    with pytest.raises(InputError, match=message):
        request_bodies.check(body(messages=[{"role": "user", "content": "hi"},
                                            tool_call(arguments)]))


@pytest.mark.parametrize("arguments", ['{"a": [1, 2]}', "not json", "", None, 5])
def test_other_tool_call_arguments_are_left_to_the_route(arguments):
    request_bodies.check(body(messages=[tool_call(arguments)]))


@pytest.mark.parametrize("kind, kept_as", [
    ("text", None), ("json_object", {"type": "json_object"}),
])
def test_a_text_response_format_is_none(kind, kept_as):
    """MAX's route makes `{"type": "text"}` a constraint to any JSON value."""
    made = openai_routes._create_response_format({"type": "text"}, True)
    assert made is not None and made.grammar_enforced and made.json_schema == {}
    body = SimpleNamespace(seed=None, response_format={"type": kind})
    request_bodies.kept(body)
    assert body.response_format == kept_as


def test_a_seed_of_0_passes_the_routes_as_0():
    """The routes write `seed or randint(...)`; a client's 0 must not be the random one."""
    request_bodies.install()
    seed = request_bodies.SeedZero(0) or 12345
    made = openai_routes.SamplingParams.from_input_and_generation_config(
        SamplingParamsInput(seed=seed),
        sampling_params_defaults=SamplingParamsGenerationConfigDefaults())
    assert made.seed == 0 and type(made.seed) is int


@pytest.mark.parametrize("fields, seed, top_logprobs", [
    (dict(seed=0, logprobs=True, top_logprobs=0), 0, 1),
    (dict(seed=5, logprobs=True, top_logprobs=3), 5, 3),
    (dict(seed=None, logprobs=False, top_logprobs=None), None, None),
    (dict(seed=None, logprobs=None, top_logprobs=0), None, 0),  # refused by `check`
])
def test_kept_sets_what_the_routes_would_read_as_none(fields, seed, top_logprobs):
    body = SimpleNamespace(**fields)
    request_bodies.kept(body)
    assert body.seed == seed and bool(body.seed) == (seed is not None)
    assert body.top_logprobs == top_logprobs


def test_kept_leaves_a_completions_body_s_logprobs():
    body = SimpleNamespace(seed=1, logprobs=0)  # 0 is also what `false` parses to
    request_bodies.kept(body)
    assert body.logprobs == 0 and not hasattr(body, "top_logprobs")


def test_a_model_the_server_does_not_serve_is_named():
    request_bodies.install()
    pipeline = SimpleNamespace(model_name="gpt2", lora_queue=None)
    request = SimpleNamespace(url=SimpleNamespace(path="/v1/completions"),
                              app=SimpleNamespace(state=SimpleNamespace(pipeline=pipeline)))
    with pytest.raises(InputError, match="Unknown model 'gpt-4', currently serving"):
        openai_routes.get_pipeline(request, "gpt-4")
    with pytest.raises(InputError) as raised:  # a lone surrogate, escaped to be sent
        openai_routes.get_pipeline(request, "\ud800")
    assert "Unknown model '\\ud800'" in str(raised.value)
    str(raised.value).encode()


def test_the_parser_it_wraps_is_there_and_wrapped_once():
    request_bodies.install()
    wrapped = openai_routes._parse_openai_request_body
    assert wrapped.checks_bodies
    get_pipeline = openai_routes.get_pipeline
    request_bodies.install()
    assert openai_routes._parse_openai_request_body is wrapped
    assert openai_routes.get_pipeline is get_pipeline  # not wrapped twice


def test_chat_log_probabilities_keep_the_alternatives_asked_for():
    """The routes' conversion of the worker's outputs, run with the count a body asked
    for (unset: MAX's answer, whole)."""
    request_bodies.install()
    process = openai_routes._process_chat_log_probabilities
    output = SimpleNamespace(
        sampled_tokens=["a", "b"], token_log_probabilities=[-0.1, -0.2],
        top_log_probabilities=[{1: ("a", -0.1), 2: ("c", -2.0)}, {3: ("b", -0.2), 1: ("a", -3.0)}])
    counts = {}
    for asked in (None, 0, 1):
        token = request_bodies.ALTERNATIVES.set(asked)
        try:
            counts[asked] = [len(t.top_logprobs) for t in process([output]).content]
        finally:
            request_bodies.ALTERNATIVES.reset(token)
    assert counts == {None: [2, 2], 0: [0, 0], 1: [1, 1]}
    request_bodies.install()
    assert openai_routes._process_chat_log_probabilities is process  # not wrapped twice


def test_a_body_s_prompts_are_all_made_before_any_is_queued():
    """MAX's completions route runs a body's prompts with `asyncio.gather`: one refused
    was answered 400 while the others, queued, generated for no one."""
    queued, made = [], []

    async def complete(self, requests):
        queued.extend(request.prompt for request in requests)
        return "answer"

    async def new_context(request):
        made.append(request.prompt)
        # MAX's tokenizer encodes each stop string, and refused one past the window.
        assert request.sampling_params.stop is None
        if request.prompt == "bad":
            raise InputError("refused")

    def bodies(*prompts):
        return [Request(prompt, SamplingParams(stop=["x" * 5000])) for prompt in prompts]

    generator = SimpleNamespace(pipeline=SimpleNamespace(
        tokenizer=SimpleNamespace(new_context=new_context)))
    checked = request_bodies.all_or_none(complete)
    with pytest.raises(InputError, match="refused"):
        asyncio.run(checked(generator, bodies("a", "b", "bad", "c")))
    assert made == ["a", "b", "bad"] and queued == []
    assert asyncio.run(checked(generator, bodies("a", "b"))) == "answer"
    assert queued == ["a", "b"]
    made.clear()
    assert asyncio.run(checked(generator, bodies("bad"))) == "answer"  # the route's own
    assert made == []


@dataclasses.dataclass
class Request:
    prompt: str
    sampling_params: SamplingParams


@pytest.mark.parametrize("temperature, greedy", [
    (1e-40, True), (1e-50, True), (9.9e-6, True), (1e-5, False), (0.7, False), (0.0, True),
])
def test_a_temperature_too_small_for_float32_logits_is_greedy(temperature, greedy):
    """Divided into the logits in float32, 1e-40 overflowed every logit (token 0 each
    step) and 1e-50 was 0 (temperature 1)."""
    params = request_bodies.CheckedSamplingParams.from_input_and_generation_config(
        SamplingParamsInput(temperature=temperature, top_k=50),
        SamplingParamsGenerationConfigDefaults())
    assert (params.temperature == 0 and params.top_k == 1) == greedy


@pytest.mark.parametrize("penalty, served", [(1e-39, False), (9e-31, False), (1e-30, True),
                                             (1.3, True)])
def test_a_repetition_penalty_too_small_for_float32_logits_is_refused(penalty, served):
    """A repeated token's positive logit is divided by it in float32: at 1e-39 the
    draws came from NaN probabilities, answered 200 with `null` log-probabilities."""
    def make():
        return request_bodies.CheckedSamplingParams.from_input_and_generation_config(
            SamplingParamsInput(repetition_penalty=penalty),
            SamplingParamsGenerationConfigDefaults())

    if served:
        assert make().repetition_penalty == penalty
        return
    with pytest.raises(InputError, match=f"repetition_penalty={penalty} is below 1e-30"):
        make()


def test_the_completions_route_answers_several_prompts_together():
    """What `all_or_none` is for: the route's answer gathers them."""
    source = inspect.getsource(openai_routes.OpenAICompletionResponseGenerator.complete)
    assert "asyncio.gather" in source


@pytest.mark.parametrize("sent", [None, [50256], []])
def test_the_client_s_stop_token_ids_are_told_from_the_model_s(sent):
    """MAX fills `stop_token_ids` with the model's EOS from `generation_config.json`
    when the client sent none; a client's list naming EOS stops under `ignore_eos`."""
    params = request_bodies.CheckedSamplingParams.from_input_and_generation_config(
        SamplingParamsInput(stop_token_ids=sent, ignore_eos=True),
        SamplingParamsGenerationConfigDefaults(eos_token_id=50256))
    assert params.stop_token_ids == (sent if sent is not None else [50256])
    assert isinstance(params.stop_token_ids, request_bodies.ClientStopTokenIds) == (
        sent is not None)
