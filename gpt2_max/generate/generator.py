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

The class is a facade over three seams: `requests.py` builds and checks
requests, `stepping.py` runs a batch of them step by step, `results.py` is
what they yield.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

from llguidance import LLTokenizer
from max.pipelines import AutoModel
from max.serve.telemetry.gc_utils import freeze_gc_heap

from .. import arch  # noqa: F401  (installs the shims before AutoModel builds its config)
from ..names import PACKAGE
from ..shims.internals import row_seed_stride
from .requests import Options, Requests, is_integer
from .results import Completion
from .stepping import StepRecorder, prefill, run

MAX_BRANCHES = 128
"""The most branches (`n`, `best_of`) one prompt gets, OpenAI's bound on `n`: each is a
row built before any runs, and a count of 2**40 ran out of memory building them."""

__all__ = ["Completion", "Generator", "Options"]


class Generator:
    """A GPT-2 checkpoint loaded in-process, ready for many calls.

    The graph is compiled once at construction; every call reuses it and the
    pre-allocated paged KV cache. Prefix caching is on, so branches of one
    prompt (`branches`) share its prefill; it never changes results, because a
    cached page holds the same keys and values a prefill would compute.

    Args:
        model_path: A checkpoint folder (`config.json`, safetensors, tokenizer).
        device: `"cpu"` or a GPU such as `"gpu:0"`; by default the device
            `max serve` picks, the first GPU where MAX sees one, else the CPU
            (on a GPU the graph runs in bfloat16 unless `quantization_encoding`
            says `"float32"`).
        max_batch_size: The most rows one step runs; larger batches and `n` are
            split into groups of this size.
        **config_overrides: Further `AutoModel` settings, such as
            `kv_cache_page_size` (the granularity at which prefixes are shared).
            `enable_structured_output` is on unless overridden: it builds MAX's
            bitmask sampler, which `grammar_engine="xgrammar"` requests run
            through as they do under `max serve --enable-structured-output`
            (the package's shim lifts MAX's CPU refusal for this architecture).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | None = None,
        max_batch_size: int = 8,
        **config_overrides: Any,
    ) -> None:
        self._model = AutoModel(
            str(model_path),
            **({} if device is None else {"devices": device}),
            max_batch_size=max_batch_size,
            custom_architectures=[PACKAGE],
            **{"enable_prefix_caching": True, "enable_structured_output": True,
               **config_overrides},
        )
        self._pipeline = StepRecorder(self._model.pipeline)
        self._requests = Requests(
            self._model.pipeline.tokenizer,
            self._model.pipeline_config.model.sampling_params_defaults,
            structured_output=self._model.pipeline_config.sampling.enable_structured_output,
        )
        self.max_batch_size = max_batch_size
        self.window = self._requests.window
        self.page_size = int(self._model.pipeline.kv_manager.params.page_size)
        self.tokenizer = self._requests.tokenizer
        """The Hugging Face tokenizer requests are encoded with."""
        # What loading leaves alive (about half a million Python objects) is
        # moved out of the collector's reach, as MAX's model worker does after
        # its warm-up: otherwise every full collection walks it, a pause of a
        # good part of a second every few hundred tokens. `close` undoes it.
        freeze_gc_heap()

    # -- public API ---------------------------------------------------------

    def generate(
        self, prompt: str | Sequence[int], max_new_tokens: int = 16, **options: Any
    ) -> Completion:
        """One continuation of `prompt` (text or token ids)."""
        (row,) = self._requests.rows([prompt], max_new_tokens, Options.parse(options))
        for _ in run(self._pipeline, [row]):
            pass
        return row.completion()

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 16, **options: Any
    ) -> list[Completion]:
        """Continuations of several prompts, run as ragged batches, in input order.

        Every prompt is its own request with the same options (and the same
        seed, as `max serve` would treat them).
        """
        rows = self._requests.rows(prompts, max_new_tokens, Options.parse(options))
        for start in range(0, len(rows), self.max_batch_size):
            for _ in run(self._pipeline, rows[start : start + self.max_batch_size]):
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
        (row,) = self._requests.rows([prompt], max_new_tokens, Options.parse(options))
        return self._pieces(run(self._pipeline, [row]))

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
        for name, value in (("n", n), ("best_of", best_of)):
            if not (is_integer(value) or value is None and name == "best_of"):
                raise TypeError(f"{name} takes an integer, not {value!r}.")
        count = int(n if best_of is None else best_of)
        if not 1 <= n <= count <= MAX_BRANCHES:
            raise ValueError(f"need 1 <= n <= best_of <= {MAX_BRANCHES}, got n={n}, "
                             f"best_of={best_of}")
        base = Options.parse(options)
        if best_of:
            base = dataclasses.replace(base, logprobs=max(base.logprobs, 1))
        stride = row_seed_stride()
        rows = self._requests.rows(
            [prompt] * count,
            max_new_tokens,
            base,
            seeds=None if base.seed is None else [base.seed + i * stride for i in range(count)],
        )
        # Only full pages are shared, so a prompt within one page is not worth a prefill.
        if count > 1 and rows[0].context.tokens.prompt_length > self.page_size:
            (context,) = self._requests.contexts([prompt], 1, Options(), [0])
            prefill(self._pipeline, context)
        for start in range(0, count, self.max_batch_size):
            for _ in run(self._pipeline, rows[start : start + self.max_batch_size]):
                pass
        completions = [row.completion() for row in rows]
        if best_of:
            completions.sort(key=lambda c: c.cumulative_logprob, reverse=True)
        return completions[:n]

    @property
    def pipeline_config(self) -> Any:
        """MAX's `PipelineConfig` the model was built with: its device and encoding."""
        return self._model.pipeline_config

    @property
    def model_steps(self) -> int:
        """Model executions (batched steps) since loading, prefills included."""
        return self._pipeline.steps

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of new tokens, as completions report it (special tokens left out)."""
        return self._requests.decode(tokens)

    @property
    def grammar_tokenizer(self) -> LLTokenizer:
        """llguidance's view of the tokenizer, built on the first constrained request."""
        return self._requests.grammar_tokenizer

    def close(self) -> None:
        self._model.close()
        self._requests.close()
        # The frozen objects include this model's; let the collector have them.
        gc.unfreeze()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
