"""The server's grammar in-process: MAX's xgrammar backend as a logits processor.

`max serve --enable-structured-output` compiles a `response_format` schema
with MAX's xgrammar backend and masks each step's logits with its bitmask,
one sampled token a step (MAX's serving loop cannot run forced tokens ahead).
`Options(grammar_engine="xgrammar")` gives the `Generator` the same engine and
the same policy, so a schema, prompt and seed give the tokens the server
gives: the schema goes through `json_schemas.prepare` as the server's
tokenizer sends it, the backend is built by the factory the server calls
(`shims.internals.xgrammar_backend`), and no token is fast-forwarded.

xgrammar, unlike llguidance, accepts any tokenization of the allowed text, so
its greedy path may spell `{"` as `{` then `"`; llguidance's canonical rule
would not. That is why the two engines' outputs differ, and why the in-process
default (llguidance, with fast-forward tokens) stays what it was.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from max.pipelines.context import ProcessorInputs, TextContext

from ..json_schemas import prepare

MASKED_LOGIT = -10000.0
"""What MAX's bitmask sampler writes over a forbidden token's logit
(`apply_packed_bitmask(..., fill_val=-10000.0)` in `max/pipelines/sampling/sampling.py`):
the same value here keeps a seeded draw the server's."""


def compile_json_schema(backend: Any, schema: str | dict[str, Any]) -> Any:
    """`schema` as the server compiles it, or ValueError with xgrammar's reason."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"json_schema: not valid JSON: {error}") from None
    schema = prepare(schema, multiple_of=False)
    try:
        return backend.compile_json_schema(schema)
    except Exception as error:  # xgrammar raises RuntimeError or ValueError
        raise ValueError(f"json_schema cannot be compiled by xgrammar: {error}") from None


@dataclass
class XgrammarMask:
    """One request's xgrammar state, with `GrammarMask`'s interface and no fast-forward."""

    backend: Any
    matcher: Any
    vocab_size: int
    forced: int = 0
    """Always 0: like the server, every token takes a step."""
    _bitmask: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self._bitmask = self.backend.allocate_token_bitmask(1, self.vocab_size)

    @classmethod
    def new(cls, backend: Any, compiled: Any, vocab_size: int) -> XgrammarMask:
        return cls(backend, backend.create_matcher(compiled), vocab_size)

    def __call__(self, inputs: ProcessorInputs) -> None:
        """Sets every token the grammar forbids to `MASKED_LOGIT` before MAX samples."""
        self.backend.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        logits = inputs.logits.to_numpy()
        allowed = np.zeros(logits.shape[1], dtype=bool)
        known = min(logits.shape[1], self.vocab_size)
        allowed[:known] = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")[
            :known
        ]
        logits[:, ~allowed] = MASKED_LOGIT

    def consume(self, token: int) -> None:
        if self.matcher.try_consume_tokens([token]) != 1:
            raise RuntimeError(f"the grammar rejected sampled token {token}")

    @property
    def finished(self) -> bool:
        """The grammar has taken its end-of-text token."""
        return self.matcher.is_stopped()

    def fast_forward(self, context: TextContext) -> list[int]:
        """Nothing: the server runs forced tokens one step each, and so does this mask."""
        return []
