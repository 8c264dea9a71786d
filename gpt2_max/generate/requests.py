"""Request building: options checked, prompts turned into the contexts `max serve` builds.

Everything a request can get wrong is found here, before any KV-cache page is
claimed or any step runs, so a bad request leaves the generator usable.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from llguidance import LLTokenizer
from max.pipelines.context import SamplingParams, SamplingParamsInput, TextContext
from max.pipelines.modeling.types import RequestID, TextGenerationRequest

from ..shims.internals import xgrammar_backend
from ..stop import StopScanner
from .constrained import GRAMMARS, GrammarMask, compile_constraint, llg_tokenizer
from .detokenize import IncrementalText
from .results import Mask, Row
from .xgrammar_mask import XgrammarMask, compile_json_schema


@dataclass(frozen=True)
class Options:
    """Per-request settings; every method of `Generator` takes them as keywords.

    `temperature=0` (the default) is greedy. `seed` picks the sampling stream as
    `max serve` does. `stop` strings cut the text before the first one (the
    rule in `gpt2_max.stop`); `stop_token_ids` end a row like EOS. `logprobs=k`
    reports each sampled token's log-probability and its k most likely
    alternatives. At most one of `json_schema`, `regex` and `grammar` (Lark)
    constrains the output. `grammar_engine` picks who enforces it: "llguidance"
    (the default: canonical tokens, forced ones fast-forwarded) or "xgrammar"
    (`json_schema` only: the engine and the one-token-a-step policy of `max
    serve --enable-structured-output`, so the same schema, prompt and seed give
    the server's tokens).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop: str | Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    grammar_engine: str = "llguidance"

    @classmethod
    def parse(cls, options: dict[str, Any]) -> Options:
        """`Options(**options)`, naming unknown keywords and the valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(options) - names):
            raise TypeError(f"unknown option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**options)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def constraint(self) -> tuple[str, Any] | None:
        given = [(kind, getattr(self, kind)) for kind in GRAMMARS if getattr(self, kind)]
        if len(given) > 1:
            raise ValueError(f"give at most one of {list(GRAMMARS)}, not {[k for k, _ in given]}")
        return given[0] if given else None


class Requests:
    """Builds the rows of requests through a pipeline's own tokenizer."""

    def __init__(self, tokenizer: Any, sampling_defaults: Any) -> None:
        self._tokenizer = tokenizer
        self._sampling_defaults = sampling_defaults
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
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, was {max_new_tokens}.")
        if not prompts:
            raise ValueError("no prompts given.")
        new_mask = self._mask_factory(options)
        contexts = self.contexts(
            prompts, max_new_tokens, options, seeds or [options.seed] * len(prompts)
        )
        rows = []
        for context in contexts:
            mask = new_mask() if new_mask else None
            if mask:
                context.sampling_params.logits_processors = [mask]
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

    def _mask_factory(self, options: Options) -> Callable[[], Mask] | None:
        """Compiles the request's constraint once; the factory gives each row its own state."""
        if (constraint := options.constraint) is None:
            return None
        kind, source = constraint
        if options.grammar_engine == "xgrammar":
            if kind != "json_schema":
                raise ValueError(f"grammar_engine 'xgrammar' serves json_schema only, not {kind}.")
            compiled = compile_json_schema(self.xgrammar_backend, source)
            vocab_size = len(self.tokenizer)
            return lambda: XgrammarMask.new(self.xgrammar_backend, compiled, vocab_size)
        if options.grammar_engine != "llguidance":
            raise ValueError(
                "grammar_engine must be 'llguidance' or 'xgrammar', "
                f"not {options.grammar_engine!r}."
            )
        grammar = compile_constraint(self.grammar_tokenizer, kind, source)
        return lambda: GrammarMask.new(self.grammar_tokenizer, grammar)

    def contexts(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int,
        options: Options,
        seeds: Sequence[int],
    ) -> list[TextContext]:
        """The contexts `max serve` would build for these requests."""
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; give at least one token of text.")
        requests = [
            TextGenerationRequest(
                request_id=RequestID(),
                model_name=__name__.partition(".")[0],
                prompt=prompt if isinstance(prompt, str) else [int(t) for t in prompt],
                logprobs=options.logprobs,
                sampling_params=SamplingParams.from_input_and_generation_config(
                    SamplingParamsInput(
                        max_new_tokens=max_new_tokens,
                        temperature=options.temperature,
                        top_k=options.top_k,
                        top_p=options.top_p,
                        seed=seed,
                        ignore_eos=options.ignore_eos,
                        stop_token_ids=list(options.stop_token_ids) or None,
                    ),
                    sampling_params_defaults=self._sampling_defaults,
                ),
            )
            for prompt, seed in zip(prompts, seeds, strict=True)
        ]

        async def build() -> list[TextContext]:
            return [await self._tokenizer.new_context(request) for request in requests]

        contexts = self._async.submit(asyncio.run, build()).result()
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
