"""Request building: options checked, prompts turned into the contexts `max serve` builds.

Everything a request can get wrong is found here, before any KV-cache page is
claimed or any step runs, so a bad request leaves the generator usable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import numbers
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from llguidance import LLTokenizer
from max.pipelines.context import SamplingParams, SamplingParamsInput, TextContext
from max.pipelines.modeling.types import RequestID, TextGenerationRequest
from max.pipelines.modeling.types.utils.serialization import (
    msgpack_numpy_decoder,
    msgpack_numpy_encoder,
)

from ..arch import gpt2_arch
from ..json_schemas import loaded
from ..names import PACKAGE
from ..shims import internals, request_bodies
from ..shims.internals import openai_response_format, xgrammar_backend
from ..stop import StopScanner
from .constrained import GRAMMARS, GrammarMask, compile_constraint, llg_tokenizer
from .detokenize import IncrementalText
from .results import Mask, Row
from .xgrammar_mask import XgrammarMask, compile_json_schema

_ENCODE = msgpack_numpy_encoder()
_DECODE = msgpack_numpy_decoder(gpt2_arch.context_type, copy=True)


def is_integer(value: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def plain(value: Any) -> Any:
    """`value` with numpy's numbers (alone or in a tuple) made Python's, as MAX's message
    encoder, which the rows pass through (`as_served`), takes them: it handed numpy's
    back to itself until Python's recursion limit."""
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if is_integer(value):
        return int(value)
    if is_number(value):
        return float(value)
    return value


def is_items(value: Any) -> bool:
    """A sequence or array of items, not text or bytes, whose items are not read as
    characters or bytes."""
    return isinstance(value, Iterable) and not isinstance(value, str | bytes | bytearray | dict)


TAKES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "temperature": ("a number", is_number),
    "top_k": ("an integer", is_integer),
    "top_p": ("a number", is_number),
    "min_p": ("a number", is_number),
    "seed": ("an integer", is_integer),
    "stop": ("a string or a list of strings",
             lambda v: isinstance(v, str) or is_items(v) and all(isinstance(s, str) for s in v)),
    "stop_token_ids": ("a list of integers", lambda v: is_items(v) and all(map(is_integer, v))),
    "ignore_eos": ("True or False", lambda v: isinstance(v, bool)),
    "logprobs": ("an integer", is_integer),
    "json_schema": ("a JSON schema, as text or a dict", lambda v: isinstance(v, str | dict)),
    "json_object": ("True or False", lambda v: isinstance(v, bool)),
    "regex": ("a string", lambda v: isinstance(v, str)),
    "grammar": ("a string", lambda v: isinstance(v, str)),
    "grammar_engine": ("a string", lambda v: isinstance(v, str)),
}
"""What each option takes, besides None where its default is None (and `seed`'s None:
a new draw each call, as `max serve` draws for a request without a seed). A value of
another type would reach MAX's request schema and fail there unnamed, or be read as
something else (`True` as 1, the characters of a string as stop strings)."""


LISTS = ("stop", "stop_token_ids")
"""The options that take a list, kept as a tuple of its items."""


def prompt_for(prompt: Any, index: int) -> str | list[int]:
    """Prompt `index` as the tokenizer takes it: text, or token ids. Bytes, floats and
    nested lists would be read as ids (a byte's value, a float cut to an integer), so
    they are refused by name.

    Raises:
        TypeError: `prompt` is neither text nor a sequence of integers.
    """
    if isinstance(prompt, str):
        return prompt
    if not is_items(prompt):
        raise TypeError(f"prompt {index} is {type(prompt).__name__}: give text or a list of "
                        "token ids.")
    ids = list(prompt)
    for position, token in enumerate(ids):
        if not is_integer(token):
            raise TypeError(f"prompt {index} holds {token!r} at position {position}: token ids "
                            "are integers.")
    return [int(token) for token in ids]


def as_served(context: TextContext) -> TextContext:
    """`context` as `max serve`'s model worker holds it: decoded from MAX's message as the
    architecture's context type, so the rooms that type carries (decode bursts, drafts)
    run in-process too."""
    return _DECODE(_ENCODE(context))


@dataclass(frozen=True)
class Options:
    """Per-request settings; every method of `Generator` takes them as keywords.

    `temperature=0` (the default) is greedy. `seed` picks the sampling stream as
    `max serve` does (None: a new draw each call, as for a request without one).
    `stop` strings cut the text before the first one (the rule in `gpt2_max.stop`);
    `stop_token_ids` end a row like EOS. `logprobs=k` reports each sampled token's
    log-probability and its k most likely alternatives. At most one of
    `json_schema`, `json_object` (any JSON object: OpenAI's
    `response_format={"type": "json_object"}`, as MAX's server reads it), `regex`
    and `grammar` (Lark) constrains the output. `grammar_engine` picks who enforces
    it: "llguidance" (the default: canonical tokens, forced ones fast-forwarded) or
    "xgrammar" (`json_schema` and `json_object` only: MAX's own structured-output
    path as `max serve --enable-structured-output` runs it, so the same schema,
    prompt and seed give the server's tokens, greedy or sampled).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = 0
    stop: str | Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    json_schema: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    grammar_engine: str = "llguidance"

    @classmethod
    def parse(cls, options: dict[str, Any]) -> Options:
        """`Options(**options)`, naming unknown keywords and the valid ones."""
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        if unknown := sorted(set(options) - set(fields)):
            raise TypeError(f"unknown option(s) {unknown}; valid options: {sorted(fields)}")
        options = {name: tuple(value) if name in LISTS and is_items(value) else value
                   for name, value in options.items()}  # an iterator read once, kept
        for name, value in options.items():
            what, takes = TAKES[name]
            if not (value is None and (fields[name] is None or name == "seed") or takes(value)):
                raise TypeError(f"{name} takes {what}, not {value!r}.")
        return cls(**{name: plain(value) for name, value in options.items()})

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def constraint(self) -> tuple[str, Any] | None:
        """The constraint's kind (a key of `GRAMMARS`) and source, if any."""
        kinds = ["json_object", *GRAMMARS]
        # Not truthiness: `json_schema={}` is a constraint (any JSON value), as under MAX.
        given = [kind for kind in kinds if getattr(self, kind) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"give at most one of {kinds}, not {given}")
        if not given:
            return None
        if given == ["json_object"]:
            return "json_schema", openai_response_format(self.response_format).json_schema
        return given[0], getattr(self, given[0])

    @property
    def response_format(self) -> dict[str, Any]:
        """The OpenAI `response_format` a client would send for a JSON constraint."""
        if self.json_object:
            return {"type": "json_object"}
        schema = loaded(self.json_schema)
        return {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}


class Requests:
    """Builds the rows of requests through a pipeline's own tokenizer."""

    def __init__(self, tokenizer: Any, sampling_defaults: Any, structured_output: bool) -> None:
        self._tokenizer = tokenizer
        self._sampling_defaults = sampling_defaults
        self._structured_output = structured_output
        """Whether the pipeline was built with MAX's structured output (its bitmask sampler)."""
        self.window = int(tokenizer.max_length)
        self.tokenizer = tokenizer.delegate
        """The Hugging Face tokenizer requests are encoded with."""
        # MAX's tokenizer is async; a private thread gives it an event loop of
        # its own, so the generator also works where one is already running.
        self._async = ThreadPoolExecutor(max_workers=1)

    def close(self) -> None:
        self._async.shutdown()

    def rows(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int,
        options: Options,
        seeds: Sequence[int] | None = None,
    ) -> list[Row]:
        """Validates everything and builds every row before any cache is claimed."""
        if not is_integer(max_new_tokens):
            raise TypeError(f"max_new_tokens takes an integer, not {max_new_tokens!r}.")
        if not 1 <= max_new_tokens <= request_bodies.INTEGERS[1]:
            raise ValueError(f"max_new_tokens must be at least 1 and a 64-bit integer, was "
                             f"{max_new_tokens}.")
        max_new_tokens = int(max_new_tokens)
        if not is_items(prompts):
            raise TypeError(f"prompts is {type(prompts).__name__}: give a list of prompts.")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given.")
        request_bodies.check(options)  # the server's rule: int64 integers, finite numbers
        internals.check_logprobs_count(options.logprobs, "logprobs")
        new_mask = self._mask_factory(options)
        contexts = self.contexts(
            prompts, max_new_tokens, options, seeds or [options.seed] * len(prompts)
        )
        rows = []
        for context in contexts:
            mask = new_mask(context) if new_mask else None
            rows.append(
                Row(
                    context=context,
                    stops=StopScanner(options.stops),
                    text=IncrementalText(self.decode),
                    mask=mask,
                    logprobs=[] if options.logprobs else None,
                    top_logprobs=[] if options.logprobs else None,
                    pending_forced=len(mask.fast_forward(context)) if mask else 0,
                )
            )
        return rows

    @cached_property
    def grammar_tokenizer(self) -> LLTokenizer:
        """llguidance's view of the tokenizer, built on the first constrained request."""
        return llg_tokenizer(self.tokenizer, self._tokenizer.tokenizer_vocab_size)

    @cached_property
    def xgrammar_backend(self) -> Any:
        """The server's grammar backend, built on the first request that asks for it."""
        return xgrammar_backend(self._tokenizer)

    def _mask_factory(self, options: Options) -> Callable[[TextContext], Mask] | None:
        """Compiles the request's constraint once; the factory attaches a fresh state
        to each row's context."""
        if (constraint := options.constraint) is None:
            return None
        kind, source = constraint
        if options.grammar_engine == "xgrammar":
            if kind != "json_schema":
                raise ValueError(
                    "grammar_engine 'xgrammar' serves json_schema and json_object only, "
                    f"not {kind}."
                )
            if not self._structured_output:
                raise ValueError(
                    "grammar_engine 'xgrammar' runs MAX's structured output; this Generator "
                    "was built with enable_structured_output=False."
                )
            compile_json_schema(self.xgrammar_backend, source)  # fails here, before any step
            return lambda context: XgrammarMask.attach(self.xgrammar_backend, context)
        if options.grammar_engine != "llguidance":
            raise ValueError(
                "grammar_engine must be 'llguidance' or 'xgrammar', "
                f"not {options.grammar_engine!r}."
            )
        grammar = compile_constraint(self.grammar_tokenizer, kind, source)
        return lambda context: GrammarMask.attach(self.grammar_tokenizer, grammar, context)

    def contexts(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int,
        options: Options,
        seeds: Sequence[int],
    ) -> list[TextContext]:
        """The contexts `max serve` would build for these requests.

        With the xgrammar engine, each request carries the `response_format` the
        server's chat route makes, so the tokenizer gives its context the schema
        MAX's pipeline constrains with.
        """
        prompts = [prompt_for(prompt, i) for i, prompt in enumerate(prompts)]
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; give at least one token of text.")
        response_format = (
            openai_response_format(options.response_format)
            if options.grammar_engine == "xgrammar" and options.constraint
            else None
        )
        requests = [
            TextGenerationRequest(
                request_id=RequestID(),
                model_name=PACKAGE,
                prompt=prompt,
                logprobs=options.logprobs,
                response_format=response_format,
                sampling_params=request_bodies.greedy_below(SamplingParams.from_input_and_generation_config(
                    SamplingParamsInput(
                        max_new_tokens=max_new_tokens,
                        temperature=options.temperature,
                        top_k=options.top_k,
                        top_p=options.top_p,
                        min_p=options.min_p,
                        seed=seed,
                        ignore_eos=options.ignore_eos,
                        stop_token_ids=request_bodies.ClientStopTokenIds(
                            options.stop_token_ids) or None,
                    ),
                    sampling_params_defaults=request_bodies.sampling_defaults(
                        options, self._sampling_defaults),
                )),
            )
            for prompt, seed in zip(prompts, seeds, strict=True)
        ]

        async def build() -> list[TextContext]:
            return [await self._tokenizer.new_context(request) for request in requests]

        contexts = [as_served(c) for c in self._async.submit(asyncio.run, build()).result()]
        for i, context in enumerate(contexts):
            if (length := context.tokens.prompt_length) >= self.window:
                raise ValueError(
                    f"prompt {i} has {length} tokens; the model's window is {self.window} "
                    "tokens, so it leaves no room for a new token."
                )
        return contexts

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of new tokens, as completions report it (special tokens left out)."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)
