"""Grammar-constrained decoding with llguidance, on the CPU or a GPU.

MAX's own structured output (xgrammar, `xgrammar_mask.py`) takes JSON schemas
only and runs one token a step, so the default engine is llguidance, applied
here through MAX's own hooks: the grammar's token mask is a
per-context logits processor, which MAX runs on the logits before its sampler
draws, and the tokens the grammar forces are appended to the context so the
next step runs them together with the sampled token, like a small prefill.

Which tokens may be forced is llguidance's rule (`compute_ff_tokens`): it
holds back the last forced bytes whenever a longer token could span the
boundary, so the forced tokens are the ones the tokenizer itself would pick.

JSON is compiled compact (no optional whitespace), as MAX's own structured
output does by default; it also keeps a sampling model from padding an object
with endless blanks. Schemas go through `gpt2_max.json_schemas.prepare` first,
as they do under `max serve`: one rule for unbounded numbers and for schemas
with no finite value in both front doors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance.hf
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from max.driver import Buffer
from max.pipelines.context import ProcessorInputs, TextContext
from transformers import PreTrainedTokenizerFast

from ..json_schemas import loaded, prepare
from ..shims.internals import run_again

JSON_OPTIONS = {"whitespace_flexible": False}


def _json_schema(schema: str | dict[str, Any]) -> str:
    schema = loaded(schema)
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}.")
    schema = prepare(schema, multiple_of=True)
    return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


GRAMMARS: dict[str, Callable[[Any], str]] = {
    "json_schema": _json_schema,
    "regex": LLMatcher.grammar_from_regex,
    "grammar": LLMatcher.grammar_from_lark,
}
"""Each constraint keyword and how llguidance turns it into a grammar."""


def llg_tokenizer(hf_tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> LLTokenizer:
    """llguidance's view of the tokenizer; building it takes about a second, so keep it."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


def compile_constraint(tokenizer: LLTokenizer, kind: str, source: Any) -> str:
    """A validated llguidance grammar for one constraint keyword.

    Raises ValueError with llguidance's message for a malformed or unsatisfiable
    constraint, so the request fails before it claims any cache or runs a step.
    """
    try:
        grammar = GRAMMARS[kind](source)
    except ValueError as error:
        raise ValueError(f"{kind}: {error}") from None
    if error := LLMatcher.validate_grammar(grammar, tokenizer):
        raise ValueError(f"{kind} cannot be compiled: {error.strip()}")
    return grammar


@dataclass
class GrammarMask:
    """One request's grammar state: a logits processor plus the forced-token rule.

    The matcher consumes every token the row gains (sampled or forced), so when
    MAX calls the processor it holds the state the next token must continue.
    """

    matcher: LLMatcher
    vocab_size: int
    forced: int = 0
    """How many tokens this row gained by fast-forwarding instead of a step each."""
    _mask: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self._mask = np.empty((self.vocab_size + 31) // 32, dtype=np.int32)

    @classmethod
    def attach(cls, tokenizer: LLTokenizer, grammar: str, context: TextContext) -> GrammarMask:
        """A fresh matcher for `grammar`, run as the context's logits processor."""
        mask = cls(LLMatcher(tokenizer, grammar, log_level=0), tokenizer.vocab_size)
        context.sampling_params.logits_processors = [mask]
        return mask

    def __call__(self, inputs: ProcessorInputs) -> None:
        """Sets every token the grammar forbids to -inf before MAX samples.

        `to_numpy` is a view of a host buffer but a copy of a device one, so on a
        GPU the masked row is copied back into MAX's buffer.
        """
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        logits = inputs.logits.to_numpy()
        # Rows past the tokenizer (a padded embedding table) are never allowed.
        allowed = np.zeros(logits.shape[1], dtype=bool)
        known = min(logits.shape[1], self.vocab_size)
        allowed[:known] = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[:known]
        logits[:, ~allowed] = -np.inf
        if not inputs.logits.is_host:
            inputs.logits.inplace_copy_from(Buffer.from_numpy(logits).to(inputs.logits.device))

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(
                f"the grammar rejected sampled token {token}: {self.matcher.get_error()}"
            )

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but the end of text."""
        return self.matcher.is_stopped()

    def fast_forward(self, context: TextContext) -> list[int]:
        """Appends the tokens the grammar forces, to be run in the next step together.

        Appended tokens would normally count as already processed (as after a
        decode step); the processing window is rewound so the next step computes
        their KV entries, one multi-token row in MAX's ragged batch. One token of
        room is left for the sampled token that step returns.
        """
        room = context.max_length - len(context.tokens) - 1
        tokens = self.matcher.compute_ff_tokens()[: max(room, 0)]
        if not tokens:
            return []
        if not self.matcher.consume_tokens(tokens):
            # llguidance validates a grammar's syntax, not that it ends: one whose
            # rules only recurse (`x: "a" x`) forces text it can never complete.
            raise ValueError(
                f"the grammar has no finite sentence: it forces the tokens {tokens} "
                "and then rejects them (does every rule have a way to end?)"
            )
        kv_length = context.tokens.processed_length
        for token in tokens:
            context.update(token)
        run_again(context.tokens, context.tokens.processed_length - kv_length)
        self.forced += len(tokens)
        return tokens
