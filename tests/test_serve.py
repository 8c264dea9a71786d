"""End to end: `max serve --custom-architectures gpt2_max` on loopback, via the openai client.

Prompts are sent as token ids and answers read back as token ids
(`return_token_ids`), so each request is compared token for token with
transformers' greedy decode of the same prompt.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer

from gpt2_max.max_cache import max_cache_dir
from gpt2_max.model_config import GPT2_VOCAB_SIZE
from gpt2_max.testing.load import GREEDY, LoadRequest, run_load
from gpt2_max.testing.reference import (
    TINY,
    hf_greedy,
    hf_prompt_logprobs,
    random_prompt,
    sampleable,
    stopped_text,
)
from gpt2_max.testing.server import MODEL_NAME, max_serve
from gpt2_max.tokenizer import PLAIN_CHAT_TEMPLATE

pytestmark = pytest.mark.tier("serve")

N_POSITIONS = TINY["n_positions"]
LOGPROBS_ATOL = 1e-4
"""About ten times the largest difference measured in these tests (README)."""


@pytest.fixture(scope="module")
def server(gpt2_max_server):
    """The plugin's session server of the "default" checkpoint: batches up to 8
    requests; prefix caching and chunked prefill at MAX's defaults."""
    return gpt2_max_server.url


@pytest.fixture(scope="module")
def chunking_server(checkpoints, tmp_path_factory):
    """Splits prefills into 64-token chunks and returns logits for every prompt token."""
    log = tmp_path_factory.mktemp("serve-chunked") / "server.log"
    with max_serve(
        checkpoints("default", "transformers-sharded"),
        "--max-batch-size", "4",
        "--max-batch-input-tokens", "64",
        "--enable-echo",
        log=log,
    ) as running:
        yield running.url


def test_the_start_says_it_compiles_before_it_does(gpt2_max_server):
    """A first start compiles for minutes: the log says so first, and where the cache is."""
    lines = gpt2_max_server.log.read_text().splitlines()
    (said,) = [i for i, line in enumerate(lines) if "gpt2_max: compiling the GPT-2 graph" in line]
    compiled = next(i for i, line in enumerate(lines) if "Compiling GPT2 took" in line)
    assert said < compiled
    assert "for float32;" in lines[said] and "minute" in lines[said]
    assert lines[said].endswith(f"later starts reuse MAX's cache at {max_cache_dir()}")


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def complete_concurrently(url: str, prompts: list[list[int]], max_tokens: int) -> list:
    """Every prompt's greedy token ids, all requests in flight at once."""
    requests = [LoadRequest(i, tuple(p), max_tokens, stream=False) for i, p in enumerate(prompts)]
    report = run_load(url, requests, concurrency=len(requests))
    assert report.failed == {}
    return [report.completed[r.index] for r in requests]


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_concurrent_requests_match_transformers(server, hf_models):
    prompts = [random_prompt(n, seed=n) for n in (1, 5, 17, 33, 64, 100, 150, 200)]
    answers = complete_concurrently(server, prompts, max_tokens=24)
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer == hf_greedy(hf_models("default"), prompt, 24)[0]


def test_repeated_long_prompt_hits_the_prefix_cache(server, hf_models):
    prompt = random_prompt(230, seed=42)
    expected = hf_greedy(hf_models("default"), prompt, 16)[0]
    first, second = (
        client(server).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, **GREEDY)
        for _ in range(2)
    )
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert token_ids(first.choices[0]) == expected
    assert token_ids(second.choices[0]) == expected


def test_streaming_delivers_the_greedy_tokens_in_pieces(server, hf_models):
    prompt = random_prompt(20, seed=7)
    stream = client(server).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, stream=True, **GREEDY
    )
    pieces = [token_ids(chunk.choices[0]) for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 1
    assert sum(pieces, []) == hf_greedy(hf_models("default"), prompt, 12)[0]


def test_an_answer_after_a_prompt_ending_inside_a_character_is_its_own_text(
    server, hf_models, checkpoints
):
    """A prompt of token ids may end inside a character ("Hello" and an emoji's first
    bytes): MAX's detokenizer, primed with it, wrote the prompt's text into the answer,
    a stop string matched there and cut the answer, and echo sent the prompt twice
    (`shims.answer_text`)."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoints("default", "hub"))
    prompt = [15496, 30325]
    assert tokenizer.decode(prompt) == "Hello \ufffd"
    expected = hf_greedy(hf_models("default"), prompt, 6)[0]
    answer = tokenizer.decode(expected).rstrip("\ufffd")  # a last unfinished one is held
    api = client(server)
    for stop in (None, ["Hello"]):
        whole = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6,
                                       stop=stop, **GREEDY).choices[0]
        assert (token_ids(whole), whole.text, whole.finish_reason) == (expected, answer, "length")
    stream = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6,
                                    stream=True, **GREEDY)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == answer
    echoed = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, echo=True,
                                    **GREEDY).choices[0]
    assert echoed.text == "Hello \ufffd" + answer


def test_logprobs_match_transformers(gpt2_max_server):
    prompt = random_prompt(30, seed=3)
    response = gpt2_max_server.client.completions.create(
        model=gpt2_max_server.model, prompt=prompt, max_tokens=6, logprobs=3, **GREEDY
    )
    choice = response.choices[0]
    reference = gpt2_max_server.reference
    assert token_ids(choice) == reference.greedy(prompt, 6)
    np.testing.assert_allclose(
        choice.logprobs.token_logprobs, reference.greedy_logprobs(prompt, 6),
        atol=LOGPROBS_ATOL, rtol=0,
    )
    for step in range(6):
        top = choice.logprobs.top_logprobs[step]
        assert len(top) == 3
        assert max(top.values()) == pytest.approx(choice.logprobs.token_logprobs[step], abs=1e-6)


def test_chat_completion_uses_the_plain_template(server, hf_models, checkpoints):
    messages = [{"role": "user", "content": "Say something."}]
    tokenizer = AutoTokenizer.from_pretrained(checkpoints("default", "hub"))
    rendered = tokenizer.apply_chat_template(
        messages, chat_template=PLAIN_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(rendered)
    response = client(server).chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, **GREEDY
    )
    choice = response.choices[0]
    expected = hf_greedy(hf_models("default"), prompt, 8)[0]
    assert choice.model_extra["prompt_token_ids"] == prompt
    assert token_ids(choice) == expected
    assert choice.message.content == tokenizer.decode(expected)


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos", "ignore-eos"])
def test_stop_token_ends_generation_at_it(server, hf_models, ignore_eos):
    """A stop token stops a request that ignores EOS too (MAX 26.7 drops it there)."""
    prompt = random_prompt(10, seed=21)
    tokens = hf_greedy(hf_models("default"), prompt, 16)[0]
    response = client(server).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0.0,
        extra_body={"stop_token_ids": [tokens[5]], "return_token_ids": True,
                    "ignore_eos": ignore_eos},
    )
    assert response.choices[0].finish_reason == "stop"
    assert token_ids(response.choices[0]) == tokens[: tokens.index(tokens[5]) + 1]


STOP_TOKENS = 24


def random_stops(
    rng: random.Random, text: str, offsets: list[int], occurring: bool
) -> list[str]:
    """1-4 stop strings: a token's text, a run of tokens, one starting inside a token,
    and strings the text never contains (only those, unless `occurring`)."""
    def piece(first: int, count: int, skip: int = 0) -> str:
        return text[offsets[first] + skip : offsets[min(first + count, STOP_TOKENS)]]

    def one() -> str:
        kind, first = rng.randrange(4) if occurring else 3, rng.randrange(STOP_TOKENS - 3)
        candidates = [
            piece(first, 1),
            piece(first, rng.randint(2, 3)),
            piece(first, 2, skip=1),
            "".join(rng.choice("xyz#~") for _ in range(rng.randint(1, 6))) + "\x07",
        ]
        return candidates[kind] or candidates[1]

    return [one() for _ in range(rng.randint(1, 4))]


def stop_request(api: OpenAI, kind: str, prompt, stops: list[str]) -> tuple[str, str]:
    """The text and finish reason of one greedy request with `stops`, as the client sees them."""
    common = dict(model=MODEL_NAME, max_tokens=STOP_TOKENS, stop=stops, **GREEDY)
    chat, stream = kind.startswith("chat"), kind.endswith("stream")
    if chat:
        response = api.chat.completions.create(messages=prompt, stream=stream, **common)
    else:
        response = api.completions.create(prompt=prompt, stream=stream, **common)
    if not stream:
        choice = response.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason
    text, finish = "", None
    for chunk in response:
        for choice in chunk.choices:
            text += (choice.delta.content if chat else choice.text) or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_stop_strings_cut_the_text_exactly(server, hf_models, checkpoints):
    """56 greedy requests with random stops, completions and chat, streamed and not."""
    rng = random.Random(2024)
    tokenizer = AutoTokenizer.from_pretrained(checkpoints("default", "hub"))
    cases = []
    for i in range(56):
        kind = ["completion", "completion-stream", "chat", "chat-stream"][i % 4]
        if kind.startswith("chat"):
            prompt = [{"role": "user", "content": f"Tell me about item {i}."}]
            ids = tokenizer.encode(tokenizer.apply_chat_template(
                prompt, chat_template=PLAIN_CHAT_TEMPLATE, add_generation_prompt=True,
                tokenize=False,
            ))
        else:
            prompt = ids = random_prompt(12, seed=500 + i)
        tokens = hf_greedy(hf_models("default"), ids, STOP_TOKENS)[0]
        text = tokenizer.decode(tokens)
        offsets = [len(tokenizer.decode(tokens[:n])) for n in range(STOP_TOKENS + 1)]
        stops = random_stops(rng, text, offsets, occurring=i % 5 != 4)
        cases.append((kind, prompt, stops, stopped_text(text, stops)))
    api = client(server)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda c: stop_request(api, *c[:3]), cases))
    wrong = [
        (kind, stops, answer, (want, "stop" if stopped else "length"))
        for (kind, _, stops, (want, stopped)), answer in zip(cases, answers, strict=True)
        if answer != (want, "stop" if stopped else "length")
    ]
    assert wrong == []
    assert 28 <= sum(stopped for *_, (_, stopped) in cases) <= 56 - 8


def test_stop_strings_keep_one_log_probability_a_token_streamed_or_not(server, checkpoints):
    """A stream's chunk whose text the stop cut to nothing kept its token but lost its
    log-probability (MAX's streaming routes drop a textless chunk's)."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoints("default", "hub"))
    for i in range(8):
        prompt = random_prompt(8, seed=700 + i)
        base = dict(model=MODEL_NAME, prompt=prompt, max_tokens=STOP_TOKENS, logprobs=2,
                    temperature=0, **GREEDY["extra_body"])
        free = httpx.post(f"{server}/v1/completions", json=base, timeout=60).json()
        ids = free["choices"][0]["token_ids"]
        ends = [len(tokenizer.decode(ids[:n])) for n in range(1, len(ids) + 1)]
        stop = free["choices"][0]["text"][ends[i % 4]:ends[i % 4] + 1 + i % 2]  # token i%4+1's
        whole = httpx.post(f"{server}/v1/completions", json={**base, "stop": [stop]},
                           timeout=60).json()
        choice, count = whole["choices"][0], whole["usage"]["completion_tokens"]
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]) == count
        assert choice["logprobs"]["token_logprobs"] == free["choices"][0]["logprobs"][
            "token_logprobs"][:count]
        with httpx.stream("POST", f"{server}/v1/completions",
                          json={**base, "stop": [stop], "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert [lp for c in chunks if c.get("logprobs")
                for lp in c["logprobs"]["token_logprobs"]] == choice["logprobs"]["token_logprobs"]
        assert "".join(c["text"] for c in chunks) == choice["text"]


def test_chat_logprobs_come_with_the_alternatives_asked_for(server):
    """MAX 26.7's route passed `top_logprobs` 0 on as no log-probabilities at all, and
    answers `logprobs` alone with one alternative a token; OpenAI's and vLLM's answers
    have each token's log-probability and none, streamed or not."""
    body = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                logprobs=True, temperature=0, **GREEDY["extra_body"])

    def tokens(stream: bool, **asked) -> list[dict]:
        answer = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                            json={**body, **asked, "stream": stream})
        if not stream:
            return answer.json()["choices"][0]["logprobs"]["content"]
        chunks = [json.loads(line[6:])["choices"] for line in answer.text.splitlines()
                  if line.startswith("data: {")]
        return [t for c in chunks if c and c[0].get("logprobs")
                for t in c[0]["logprobs"]["content"]]

    for stream in (False, True):
        asked = {n: tokens(stream, top_logprobs=n) for n in (0, 1, 3)}
        asked[None] = tokens(stream)
        for n, got in asked.items():
            assert len(got) == 5 and all(len(t["top_logprobs"]) == (n or 0) for t in got)
            assert [t["logprob"] for t in got] == [t["logprob"] for t in asked[3]]
        assert all(t["top_logprobs"][0]["logprob"] == t["logprob"] for t in asked[1])


def test_same_seed_samples_the_same_tokens(server):
    prompt = random_prompt(10, seed=11)
    sample = lambda: token_ids(  # noqa: E731
        client(server)
        .completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=1.0, seed=1234,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        .choices[0]
    )
    assert sample() == sample()


def test_min_p_keeps_only_the_tokens_it_allows(server):
    """MAX 26.7's CPU sampling kernel drew as if min_p were 0 (`shims.min_p`): at 1 only
    the largest logit is left, so a seeded draw at temperature 1 is the greedy answer,
    with and without a top-k, where without min_p it is not."""
    def answer(**options) -> list[int]:
        response = client(server).completions.create(
            model=MODEL_NAME, prompt=random_prompt(6, seed=4), max_tokens=8,
            temperature=options.pop("temperature", 1.0), seed=5,
            extra_body={"ignore_eos": True, "return_token_ids": True, **options},
        )
        return token_ids(response.choices[0])

    greedy = answer(temperature=0.0)
    assert answer() != greedy
    assert answer(min_p=1.0) == greedy
    assert answer(min_p=1.0, top_k=20) == greedy


def test_max_tokens_past_the_window_stops_at_the_window(server, hf_models):
    prompt = random_prompt(N_POSITIONS - 10, seed=5)
    response = client(server).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=100, **GREEDY
    )
    assert response.choices[0].finish_reason == "length"
    assert token_ids(response.choices[0]) == hf_greedy(hf_models("default"), prompt, 10)[0]


@pytest.mark.parametrize(
    "body, message",
    [
        (dict(prompt=list(range(N_POSITIONS + 1))), "Prompt is too long"),
        (
            dict(prompt=[15496, 995, GPT2_VOCAB_SIZE]),
            f"token id {GPT2_VOCAB_SIZE} at position 2 is outside",
        ),
        (dict(prompt=[15496, -1]), "token id -1 at position 1 is outside"),
        (dict(prompt="Hi", echo=True, logprobs=1), "start the server with --enable-echo"),
        (dict(prompt="Hi", max_tokens="many"), ""),
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt=[]), "prompt is empty"),
        (dict(prompt=[[]]), "prompt is empty"),
        (dict(prompt=[[15496], [995]], stream=True), "stream answers one prompt"),
        (dict(prompt=["Hi", "there"], stream=True), "stream answers one prompt"),
        (dict(prompt="Hi", max_tokens=-3), "max_new_tokens must be a non-negative integer"),
        (dict(prompt="Hi", max_tokens=0), "max_tokens must be at least 1, was 0"),
        (dict(prompt="Hi", temperature=-1), "temperature must be in [0.0, 2.0], was -1"),
        (dict(prompt="Hi", top_p=7), "top_p must be in [0.0, 1.0], was 7"),
        (dict(prompt="Hi", top_k=-5), "top_k must be -1 or greater than 0, was -5"),
        (dict(prompt="Hi", frequency_penalty=1e9), "frequency_penalty=1000000000.0 is not"),
        (dict(prompt="Hi", presence_penalty=1.5), "started without --enable-penalties"),
        (dict(prompt="Hi", min_tokens=2), "started without --enable-min-tokens"),
        (dict(prompt="Hi", n=2), "n=2 is not served: this server gives one choice"),
        (dict(prompt="Hi", best_of=2), "best_of=2 is not served"),
        (dict(prompt="Hi", logit_bias={"13": 50}), "is not served: this server applies no logit"),
        (dict(prompt="Hi", suffix="."), "suffix='.' is not served"),
        (dict(prompt="Hi", seed=2**64), "seed holds 18446744073709551616, past the 64-bit"),
        (dict(prompt="Hi", stop_token_ids=[-(2**63) - 1]), "stop_token_ids holds"),
        (dict(prompt="Hi", top_k=2**63, temperature=1.0), "top_k holds 9223372036854775808"),
        (dict(prompt="Hi", stop_token_ids=[13, 2**40]),
         "stop token id 1099511627776 at position 1 is outside the vocabulary"),
        (dict(prompt="Hi", stop_token_ids=[-5]), "stop token id -5 at position 0 is outside"),
        (dict(prompt="Hi", top_p=float("nan")), "top_p is nan: give a finite number"),
        (dict(prompt="Hi", model="\ud800"), "Unknown model '\\\\ud800'"),
        (dict(prompt="Hi", logprobs=10_000), ""),
        (dict(prompt="x " * 5_000_000), ""),
        (dict(prompt={"not": "a prompt"}), ""),
    ],
    ids=[
        "too-long", "out-of-vocab", "negative-id", "echo-not-enabled", "wrong-type",
        "empty-prompt", "empty-prompt-list", "empty-token-list", "streamed-prompts",
        "streamed-strings", "negative-max-tokens", "zero-max-tokens", "negative-temperature",
        "top-p-7", "negative-top-k", "huge-penalty", "penalty-not-enabled",
        "min-tokens-not-enabled", "n-2", "best-of-2",
        "logit-bias", "suffix", "seed-2**64", "stop-token-past-64-bits",
        "top-k-2**63", "stop-token-2**40", "negative-stop-token", "nan-top-p",
        "lone-surrogate-model",
        "huge-logprobs", "10mb-body", "prompt-object",
    ],
)
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, hf_models, body, message):
    response = httpx.post(  # json.dumps escapes a lone surrogate, which httpx's json= refuses
        f"{server}/v1/completions", content=json.dumps({"model": MODEL_NAME, "max_tokens": 4,
                                                        **body}),
        headers={"content-type": "application/json"}, timeout=60,
    )
    assert 400 <= response.status_code < 500, response.text
    assert message in response.text
    prompt = random_prompt(12, seed=99)
    after = client(server).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, **GREEDY
    )
    assert token_ids(after.choices[0]) == hf_greedy(hf_models("default"), prompt, 4)[0]


def test_a_body_nested_past_python_s_recursion_gets_400(server):
    """MAX's body parser (`json.loads`) raises `RecursionError` on it, which no route
    catches."""
    body = '{"model": "gpt2", "prompt": ' + "[" * 5000 + "]" * 5000 + "}"
    response = httpx.post(f"{server}/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert "the request body cannot be read: nested too deep" in response.text


def test_a_top_k_past_the_vocabulary_keeps_every_token(server):
    """A top_k of 2**31 beside top_p stopped MAX 26.7's model worker; it is cut to the
    vocabulary, whose every token it keeps, so the seeded answer is top_k=vocabulary's."""
    def answer(top_k: int) -> list[int]:
        response = client(server).completions.create(
            model=MODEL_NAME, prompt=random_prompt(6, seed=3), max_tokens=8,
            temperature=1.0, top_p=0.9, seed=11,
            extra_body={"top_k": top_k, "return_token_ids": True},
        )
        return token_ids(response.choices[0])

    assert answer(2**31) == answer(2**62) == answer(GPT2_VOCAB_SIZE)


@pytest.mark.parametrize(
    "body, message",
    [
        (dict(n=3), "n=3 is not served: this server gives one choice"),
        (dict(logit_bias={"13": 50}), "is not served: this server applies no logit bias"),
        (dict(temperature=2.5), "temperature must be in [0.0, 2.0], was 2.5"),
        (dict(max_completion_tokens=0), "max_tokens must be at least 1, was 0"),
        (dict(seed=2**64), "seed holds 18446744073709551616, past the 64-bit"),
        (dict(model="gpt-4"), "Unknown model 'gpt-4', currently serving"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
              tool_choice="required"), "this server has no tool parser"),
        (dict(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}),
         "modalities=['text', 'audio'] is not served: this server answers in text"),
        (dict(functions=[{"name": "f", "parameters": {}}], function_call={"name": "f"}),
         "functions is not served: give them as tools"),
        (dict(web_search_options={}), "web_search_options={} is not served"),
        (dict(top_logprobs=2), "top_logprobs is set and logprobs is not"),
        (dict(messages=[{"role": "user", "content": [
            {"type": "text", "text": "Hi"},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]),
         "a content part of type 'input_audio' is not served: this server reads text parts"),
        (dict(chat_template_kwargs={"tokenize": True}),
         "chat_template_kwargs holds 'tokenize', which the server sets itself"),
        (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs holds 'messages'"),
        (dict(chat_template_kwargs={"documents": "x"}),
         "the chat template cannot render this chat: Documents should be a list"),
    ],
    ids=["n-3", "logit-bias", "temperature-2.5", "zero-max-completion-tokens", "seed-2**64",
         "unknown-model", "required-tool-call", "audio-out", "functions", "web-search",
         "top-logprobs-alone", "audio-part", "template-tokenize", "template-messages",
         "template-documents"],
)
def test_bad_chat_requests_get_400_saying_why(server, body, message):
    response = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 4, **body},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert message in response.text


@pytest.fixture(scope="module")
def llama_parser_server(gpt2_max_checkpoint, tmp_path_factory):
    """MAX's one tool parser registered for any model, `llama`, which reads calls from
    the model's text and builds no grammar that would force one."""
    log = tmp_path_factory.mktemp("serve-llama-parser") / "server.log"
    with max_serve(gpt2_max_checkpoint, "--max-batch-size", "2", "--tool-parser", "llama",
                   log=log) as running:
        yield running.url


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_from_a_parser_that_cannot_force_one_gets_400(
    llama_parser_server, stream
):
    """MAX answered it with the model's text, `finish_reason` "length", no call."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Paris?"}],
            "tools": tools, "max_tokens": 4, "stream": stream}
    url = f"{llama_parser_server}/v1/chat/completions"
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        response = httpx.post(url, json={**body, "tool_choice": choice}, timeout=120)
        assert response.status_code == 400, response.text
        assert "tool parser (LlamaToolParser) reads calls from the model's text but builds " \
               "no grammar that forces one" in response.text
    assert httpx.post(url, json={**body, "stream": False, "tool_choice": "auto"},
                      timeout=120).status_code == 200


def test_a_text_response_format_is_answered_in_text_and_the_server_stays_up(
    llama_parser_server,
):
    """MAX's chat route made OpenAI's `{"type": "text"}` a constraint to any JSON value,
    which a server with a tool parser and without --enable-structured-output refused
    in its model worker: "Worker crashed", the server gone."""
    url = f"{llama_parser_server}/v1/chat/completions"
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 6, "return_token_ids": True, "temperature": 0, "ignore_eos": True}
    answers = [httpx.post(url, json=b, timeout=120)
               for b in ({**body, "response_format": {"type": "text"}}, body)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    tokens = [a.json()["choices"][0]["token_ids"] for a in answers]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions",
     '{"model": "gpt2", "prompt": "Hi", "max_tokens": 2, "seed": ' + "1" * 5000 + "}",
     "the request body cannot be read: an integer of more than 4300 digits"),
    ("/v1/chat/completions", json.dumps({"model": "gpt2", "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "[" * 5000}}]}]}),
     "the arguments of tool call 'c1' cannot be read: nested too deep"),
])
def test_json_python_cannot_read_gets_400_naming_where(server, path, body, message):
    """The first was answered "Value error.", the second 500 (the chat route parses a
    tool call's arguments itself)."""
    response = httpx.post(f"{server}{path}", content=body,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.text


def test_a_body_of_prompts_one_refused_is_refused_whole(server):
    """Each prompt's request is made before any is queued (`request_bodies.all_or_none`):
    the others generated to their end for no one."""
    body = {"model": MODEL_NAME, "prompt": [[464, 3290], [464, 3290], [GPT2_VOCAB_SIZE]],
            "max_tokens": 4, "ignore_eos": True}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert f"token id {GPT2_VOCAB_SIZE} at position 0 is outside" in response.text
    body["prompt"] = body["prompt"][:2]
    answer = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    assert answer["usage"]["completion_tokens"] == 8


def test_a_body_that_is_not_utf8_gets_400_saying_so(server):
    response = httpx.post(f"{server}/v1/completions",
                          content=b'{"model": "gpt2", "prompt": "\xff\xfe", "max_tokens": 2}',
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert "the request body is not UTF-8: invalid start byte at byte 29" in response.text


@pytest.mark.parametrize("body", [dict(input="Hi"), dict(input=["Hi", "there"]), dict(input="")])
def test_embeddings_get_404_from_a_text_generation_server(server, hf_models, body):
    """MAX 26.7 sent them to the text worker and answered 500."""
    response = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL_NAME, **body},
                          timeout=60)
    assert response.status_code == 404, response.text
    assert "not serving an embeddings model" in response.json()["error"]["message"]
    prompt = random_prompt(12, seed=98)
    after = client(server).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, **GREEDY
    )
    assert token_ids(after.choices[0]) == hf_greedy(hf_models("default"), prompt, 4)[0]


@pytest.fixture(scope="module")
def echo_server(checkpoints, tmp_path_factory):
    """Returns logits for every prompt token, with MAX's prefill chunks and prefix cache,
    and applies penalties."""
    log = tmp_path_factory.mktemp("serve-echo") / "server.log"
    with max_serve(checkpoints("default", "hub"), "--max-batch-size", "2", "--enable-echo",
                   "--enable-penalties", log=log) as running:
        yield running.url


def hf_greedy_penalized(model, prompt: list[int], new_tokens: int, repetition: float,
                        presence: float) -> tuple[list[int], list[float]]:
    """transformers' greedy decode with MAX's penalties, and each token's
    log-probability in the distribution it was drawn from: repetition on every token
    seen (prompt and answer) divides a positive logit and multiplies a negative one;
    presence is taken off each token the answer holds."""
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1, :sampleable(model)]
            logits = logits.double().numpy().copy()
            seen = np.unique(prompt + tokens)
            logits[seen] = np.where(logits[seen] > 0, logits[seen] / repetition,
                                    logits[seen] * repetition)
            logits[np.unique(tokens).astype(int)] -= presence
            tokens.append(int(logits.argmax()))
            shifted = logits - logits.max()
            logprobs.append(float(shifted[tokens[-1]] - np.log(np.exp(shifted).sum())))
    return tokens, logprobs


def test_penalties_are_applied_beside_echo(echo_server, hf_models):
    """MAX 26.7's model worker could not start with `--enable-echo --enable-penalties`
    (`shims.echo_penalties`); now a request's penalties choose its tokens. Its prompt's
    log-probabilities are the model's, its answer's those of the distribution sampled,
    with echo or without, as on a server without `--enable-echo` (they were the model's
    own here)."""
    model = hf_models("default")
    prompt = random_prompt(40, seed=23)
    want, drawn = hf_greedy_penalized(model, prompt, 16, repetition=1.8, presence=1.5)
    assert want != hf_greedy(model, prompt, 16)[0]  # the penalties decide
    for echo in (True, False):
        response = client(echo_server).completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=16, echo=echo, logprobs=1,
            presence_penalty=1.5, temperature=0.0,
            extra_body={**GREEDY["extra_body"], "repetition_penalty": 1.8},
        )
        assert token_ids(response.choices[0]) == want
        reported = response.choices[0].logprobs.token_logprobs
        if echo:
            assert len(reported) == len(prompt) + len(want) and reported[0] is None
            np.testing.assert_allclose(reported[1 : len(prompt)],
                                       hf_prompt_logprobs(model, prompt),
                                       atol=LOGPROBS_ATOL, rtol=0)
            reported = reported[len(prompt):]
        np.testing.assert_allclose(reported, drawn, atol=LOGPROBS_ATOL, rtol=0)


def test_echo_counts_every_prompt_token_when_the_prefix_cache_holds_them(
    echo_server, hf_models
):
    """The prompt asked again, or after another sharing its first pages: MAX skipped the
    cached pages, and echo answered without their tokens' log-probabilities (a
    200-token prompt asked twice: 72 of 200). Others still read the cache."""
    prompt = random_prompt(200, seed=21)
    expected = hf_prompt_logprobs(hf_models("default"), prompt)
    api = client(echo_server)
    plain = [api.completions.create(model=MODEL_NAME, prompt=prompt[:150] + [11] * 50,
                                    max_tokens=1, **GREEDY) for _ in range(2)]
    assert plain[1].usage.prompt_tokens_details.cached_tokens == 128  # a page
    for _ in range(2):
        response = api.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=1, echo=True, logprobs=1, **GREEDY
        )
        reported = response.choices[0].logprobs.token_logprobs
        assert len(reported) == len(prompt) + 1 and reported[0] is None
        np.testing.assert_allclose(reported[1:-1], expected, atol=LOGPROBS_ATOL, rtol=0)
        assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_chunked_prefill_matches_transformers(chunking_server, hf_models):
    prompts = [random_prompt(n, seed=n) for n in (70, 130, 190, 250)]
    answers = complete_concurrently(chunking_server, prompts, max_tokens=6)
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer == hf_greedy(hf_models("default"), prompt, 6)[0]


@pytest.mark.parametrize("length", [60, 200])
def test_echo_answers_as_openai_with_every_prompt_token(chunking_server, checkpoints, hf_models,
                                                        length):
    """The prompt's text, then the completion's; a log-probability entry per token, the
    prompt's first `null` (OpenAI's and vLLM's shape: MAX left it out, so a client
    reading entries by position read each a token early), the prompt's others as
    transformers scores them, also across the server's 64-token prefill chunks (MAX
    kept the last chunk's alone). Streamed, the same in pieces."""
    model = hf_models("default")
    prompt = random_prompt(length, seed=8)
    api = client(chunking_server)
    response = api.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=3, echo=True, logprobs=1, **GREEDY
    )
    (choice,) = response.choices
    logprobs = choice.logprobs
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == length + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(logprobs.token_logprobs[1:length],
                               hf_prompt_logprobs(model, prompt), atol=LOGPROBS_ATOL, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(checkpoints("default", "hub"))
    assert choice.text == tokenizer.decode(prompt) + tokenizer.decode(token_ids(choice))
    streamed = api.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=3, echo=True, logprobs=1, stream=True,
        **GREEDY,
    )
    chunks = [chunk.choices[0] for chunk in streamed if chunk.choices]
    assert "".join(chunk.text for chunk in chunks) == choice.text
    assert [entry for chunk in chunks if chunk.logprobs
            for entry in chunk.logprobs.token_logprobs] == logprobs.token_logprobs


def test_echo_of_a_request_preempted_while_it_decodes_scores_each_token_once(
    checkpoints, hf_models, tmp_path
):
    """Four requests of 100 prompt tokens and 60 new on a cache of four pages (512
    tokens): each needs a second page while it decodes, so MAX preempts some and later
    prefills each again with its tokens so far as its prompt. Their echo answered that
    prompt's entries again in the middle of the answer (288 entries where 160 are due,
    in one run); now each token has one, transformers' own."""
    model = hf_models("default")
    prompts = [random_prompt(100, seed=700 + i) for i in range(4)]
    log = tmp_path / "server.log"
    with max_serve(checkpoints("default", "hub"), "--max-batch-size", "4",
                   "--max-batch-total-tokens", "512", "--enable-echo", log=log) as running:
        api = client(running.url)
        with ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(lambda prompt: api.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=60, echo=True, logprobs=1, **GREEDY
            ), prompts))
        assert "Preempted a request due to lack of KV pages" in log.read_text()
    for prompt, response in zip(prompts, responses, strict=True):
        (choice,) = response.choices
        tokens = token_ids(choice)
        assert tokens == hf_greedy(model, prompt, 60)[0]
        reported = choice.logprobs.token_logprobs
        assert len(reported) == 160 and reported[0] is None
        np.testing.assert_allclose(reported[1:], hf_prompt_logprobs(model, prompt + tokens),
                                   atol=LOGPROBS_ATOL, rtol=0)


def test_echo_without_logprobs_puts_the_prompt_before_the_completion(server, checkpoints,
                                                                    hf_models):
    prompt = random_prompt(12, seed=31)
    response = client(server).completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=5, echo=True, **GREEDY
    )
    (choice,) = response.choices
    assert token_ids(choice) == hf_greedy(hf_models("default"), prompt, 5)[0]
    assert not (choice.logprobs and choice.logprobs.token_logprobs)
    tokenizer = AutoTokenizer.from_pretrained(checkpoints("default", "hub"))
    assert choice.text == tokenizer.decode(prompt) + tokenizer.decode(token_ids(choice))


def test_seeded_sampling_matches_the_in_process_generator(server, generator):
    """The same request with the same seed draws the same tokens in-process and served;
    seed 0 too, which MAX 26.7's routes take for no seed."""
    prompt = random_prompt(12, seed=8)
    for seed in (0, 1, 2):
        options = dict(temperature=1.0, top_p=0.9, seed=seed)
        response = client(server).completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=16,
            extra_body={"return_token_ids": True}, **options,
        )
        in_process = generator.generate(prompt, 16, **options)
        assert token_ids(response.choices[0]) == in_process.token_ids
        assert response.choices[0].text == in_process.text
