"""In-process generation: load a checkpoint once, then generate, batch, stream or branch.

Built on MAX's own in-process pipeline rather than beside it: `AutoModel` loads
and compiles the model once, `pipeline.tokenizer.new_context` turns each request
into the same `TextContext` `max serve` builds (so a seeded request draws the
same tokens), and `GenerateIterator.from_contexts` runs a fixed batch one
`execute` per step with MAX's sampler and each context's own sampling
parameters and logits processors. What MAX has no in-process form of is added
on top: text and stop strings (`gpt2_max.stop`), UTF-8-safe streaming,
branches that share one prefill through the prefix cache, and grammar
constraints (`constrained.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from llguidance import LLTokenizer
from max.pipelines import AutoModel
from max.pipelines.context import (
    GenerationStatus,
    SamplingParams,
    SamplingParamsInput,
    TextContext,
)
from max.pipelines.lib.generate import GenerateIterator
from max.pipelines.modeling.types import RequestID, TextGenerationRequest

from .constrained import GRAMMARS, GrammarMask, compile_constraint, llg_tokenizer
from .detokenize import IncrementalText
from ..shims.internals import ROW_SEED_STRIDE
from ..stop import StopScanner

FINISH_REASONS = {
    GenerationStatus.END_OF_SEQUENCE: "stop",
    GenerationStatus.MAXIMUM_LENGTH: "length",
}
"""MAX's reason a row ended, in OpenAI's words."""


@dataclass(frozen=True)
class Options:
    """Per-request settings; every method of `Generator` takes them as keywords.

    `temperature=0` (the default) is greedy. `seed` picks the sampling stream as
    `max serve` does. `stop` strings cut the text before the first one (the
    rule in `gpt2_max.stop`); `stop_token_ids` end a row like EOS. `logprobs=k`
    reports each sampled token's log-probability and its k most likely
    alternatives. At most one of `json_schema`, `regex` and `grammar` (Lark)
    constrains the output.
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


@dataclass
class Completion:
    """One generated continuation."""

    text: str
    """The decoded new tokens, cut before the first stop string."""
    token_ids: list[int]
    """Every new token, the one that completed a stop string or EOS included."""
    finish_reason: str
    """"stop" (EOS, a stop token or string, or a complete grammar) or "length"."""
    prompt_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose KV entries came from the prefix cache instead of a prefill."""
    steps: int = 0
    """Model steps that sampled a token for this request."""
    forced_tokens: int = 0
    """Tokens a grammar forced and that ran inside another step (steps saved)."""
    logprobs: list[float | None] | None = None
    """Log-probability of each new token; None for tokens a grammar forced."""
    top_logprobs: list[dict[int, float]] | None = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp for lp in self.logprobs or () if lp is not None)


class _OutputRecorder:
    """The pipeline as `GenerateIterator` sees it, keeping each step's outputs.

    A batch from `from_contexts` hands back only token ids; the log-probabilities
    MAX computes for a context that asks for them travel in the step's outputs.
    """

    def __init__(self, pipeline: Any) -> None:
        self._pipeline = pipeline
        self.outputs: dict[RequestID, Any] = {}
        self.steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)

    def execute(self, inputs: Any) -> Any:
        self.outputs = self._pipeline.execute(inputs)
        self.steps += 1
        return self.outputs


@dataclass
class _Row:
    """One request in flight: its context and what has been made of its tokens."""

    context: TextContext
    stops: StopScanner
    text: IncrementalText
    mask: GrammarMask | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    steps: int = 0
    pending_forced: int = 0
    finish_reason: str | None = None

    def completion(self) -> Completion:
        return Completion(
            text=self.stops.text[: self.stops.released],
            token_ids=self.tokens,
            finish_reason=self.finish_reason or "length",
            prompt_tokens=self.context.tokens.prompt_length,
            cached_tokens=self.context.cached_prefix_length or 0,
            steps=self.steps,
            forced_tokens=self.mask.forced if self.mask else 0,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
        )


class Generator:
    """A GPT-2 checkpoint loaded in-process, ready for many calls.

    The graph is compiled once at construction; every call reuses it and the
    pre-allocated paged KV cache. Prefix caching is on, so branches of one
    prompt (`branches`) share its prefill; it never changes results, because a
    cached page holds the same keys and values a prefill would compute.

    Args:
        model_path: A checkpoint folder (`config.json`, safetensors, tokenizer).
        device: `"cpu"` or a GPU such as `"gpu:0"`.
        max_batch_size: The most rows one step runs; larger batches and `n` are
            split into groups of this size.
        **config_overrides: Further `AutoModel` settings, such as
            `kv_cache_page_size` (the granularity at which prefixes are shared).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        max_batch_size: int = 8,
        **config_overrides: Any,
    ) -> None:
        self._model = AutoModel(
            str(model_path),
            devices=device,
            max_batch_size=max_batch_size,
            custom_architectures=["gpt2_max"],
            **{"enable_prefix_caching": True, **config_overrides},
        )
        self._pipeline = _OutputRecorder(self._model.pipeline)
        self._tokenizer = self._model.pipeline.tokenizer
        self.max_batch_size = max_batch_size
        self.window = int(self._tokenizer.max_length)
        self.page_size = int(self._model.pipeline.kv_manager.params.page_size)
        # MAX's tokenizer is async; a private thread gives it an event loop of
        # its own, so the generator also works where one is already running.
        self._async = ThreadPoolExecutor(max_workers=1)
        self.tokenizer = self._tokenizer.delegate
        """The Hugging Face tokenizer requests are encoded with."""

    # -- public API ---------------------------------------------------------

    def generate(
        self, prompt: str | Sequence[int], max_new_tokens: int = 16, **options: Any
    ) -> Completion:
        """One continuation of `prompt` (text or token ids)."""
        (row,) = self._rows([prompt], max_new_tokens, Options.parse(options))
        for _ in self._run([row]):
            pass
        return row.completion()

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 16, **options: Any
    ) -> list[Completion]:
        """Continuations of several prompts, run as ragged batches, in input order.

        Every prompt is its own request with the same options (and the same
        seed, as `max serve` would treat them).
        """
        rows = self._rows(prompts, max_new_tokens, Options.parse(options))
        for start in range(0, len(rows), self.max_batch_size):
            for _ in self._run(rows[start : start + self.max_batch_size]):
                pass
        return [row.completion() for row in rows]

    def stream(
        self, prompt: str | Sequence[int], max_new_tokens: int = 16, **options: Any
    ) -> Iterator[str]:
        """Text pieces of one continuation as its tokens arrive.

        Pieces never end inside a UTF-8 character or inside a possible stop
        string. Closing the iterator (or leaving a `for` loop early) cancels
        the request and frees its cache pages.
        """
        # Validated here, so a bad request raises at the call, not at the first piece.
        (row,) = self._rows([prompt], max_new_tokens, Options.parse(options))
        return self._pieces(self._run([row]))

    @staticmethod
    def _pieces(run: Iterator[tuple[int, str]]) -> Iterator[str]:
        with closing(run):  # closing the stream releases the row at once
            for _, piece in run:
                yield piece

    def branches(
        self,
        prompt: str | Sequence[int],
        n: int,
        max_new_tokens: int = 16,
        *,
        best_of: int | None = None,
        **options: Any,
    ) -> list[Completion]:
        """`n` continuations of one prompt, each sampled with its own seed.

        The prompt is prefilled once; every branch then finds its full KV pages
        in the prefix cache (`Completion.cached_tokens`) and all branches advance
        together, one batched step per token. With `best_of`, that many branches
        run and the `n` with the highest cumulative log-probability are returned,
        best first.
        """
        count = best_of or n
        if not 1 <= n <= count:
            raise ValueError(f"need 1 <= n <= best_of, got n={n}, best_of={best_of}")
        base = Options.parse(options)
        if best_of:
            base = dataclasses.replace(base, logprobs=max(base.logprobs, 1))
        rows = self._rows(
            [prompt] * count,
            max_new_tokens,
            base,
            seeds=[base.seed + i * ROW_SEED_STRIDE for i in range(count)],
        )
        # Only full pages are shared, so a prompt within one page is not worth a prefill.
        if count > 1 and rows[0].context.tokens.prompt_length > self.page_size:
            self._prefill(prompt)
        for start in range(0, count, self.max_batch_size):
            for _ in self._run(rows[start : start + self.max_batch_size]):
                pass
        completions = [row.completion() for row in rows]
        if best_of:
            completions.sort(key=lambda c: c.cumulative_logprob, reverse=True)
        return completions[:n]

    @property
    def model_steps(self) -> int:
        """Model executions (batched steps) since loading, prefills included."""
        return self._pipeline.steps

    def close(self) -> None:
        self._model.close()
        self._async.shutdown()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -----------------------------------------------------------

    def _rows(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int,
        options: Options,
        seeds: Sequence[int] | None = None,
    ) -> list[_Row]:
        """Validates everything and builds every row before any cache is claimed."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, was {max_new_tokens}.")
        if not prompts:
            raise ValueError("no prompts given.")
        grammar = self._grammar(options)
        contexts = self._contexts(
            prompts, max_new_tokens, options, seeds or [options.seed] * len(prompts)
        )
        rows = []
        for context in contexts:
            mask = GrammarMask.new(self.grammar_tokenizer, grammar) if grammar else None
            if mask:
                context.sampling_params.logits_processors = [mask]
            rows.append(
                _Row(
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

    def _grammar(self, options: Options) -> str | None:
        if (constraint := options.constraint) is None:
            return None
        return compile_constraint(self.grammar_tokenizer, *constraint)

    def _contexts(
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
        defaults = self._model.pipeline_config.model.sampling_params_defaults
        requests = [
            TextGenerationRequest(
                request_id=RequestID(),
                model_name="gpt2_max",
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
                    sampling_params_defaults=defaults,
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

    # -- running ------------------------------------------------------------

    def _prefill(self, prompt: str | Sequence[int]) -> None:
        """Runs the prompt once so its full KV pages land in the prefix cache."""
        (context,) = self._contexts([prompt], 1, Options(), [0])
        with GenerateIterator.from_contexts(self._pipeline, [context], caller="Generator") as batch:
            while not batch.done:
                batch.step()

    def _run(self, rows: list[_Row]) -> Iterator[tuple[int, str]]:
        """Steps `rows` as one batch until each ends; yields (row, released text)."""
        contexts = [row.context for row in rows]
        with GenerateIterator.from_contexts(self._pipeline, contexts, caller="Generator") as batch:
            while not batch.done:
                for index, new_tokens in batch.step().items():
                    row = rows[index]
                    self._advance(row, new_tokens)
                    piece = row.stops.feed(row.text.feed(row.tokens))
                    if not self._continues(row):
                        piece += row.stops.feed(row.text.flush(row.tokens)) + row.stops.flush()
                        row.finish_reason = "stop" if row.stops.stopped else row.finish_reason
                        batch.remove(index)
                    if piece:
                        yield index, piece

    def _advance(self, row: _Row, new_tokens: list[int]) -> None:
        """Books one step's tokens: forced ones from the step before, then the sampled one."""
        row.tokens.extend(new_tokens)
        row.steps += 1
        if row.logprobs is not None:
            output = self._pipeline.outputs[row.context.request_id]
            (sampled,) = output.log_probabilities
            row.logprobs += [None] * row.pending_forced + sampled.token_log_probabilities
            row.top_logprobs += [{}] * row.pending_forced + sampled.top_log_probabilities
        row.pending_forced = 0
        if row.mask and not row.context.is_done:
            row.mask.consume(new_tokens[-1])

    def _continues(self, row: _Row) -> bool:
        """Whether the row takes another step; if not, records why it ended."""
        if row.context.is_done:
            row.finish_reason = FINISH_REASONS[row.context.status]
        elif row.stops.stopped or (row.mask and row.mask.finished):
            row.finish_reason = "stop"
        elif row.mask is None:
            return True
        else:
            forced = row.mask.fast_forward(row.context)
            if not row.mask.finished:
                row.pending_forced = len(forced)
                return True
            # The forced tokens complete the grammar: they need no step of their own.
            row.tokens += forced
            if row.logprobs is not None and row.top_logprobs is not None:
                row.logprobs += [None] * len(forced)
                row.top_logprobs += [{}] * len(forced)
            row.finish_reason = "stop"
        return False
