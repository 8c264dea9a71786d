"""The server's grammar in-process: MAX's own structured-output path, run by the `Generator`.

`max serve --enable-structured-output` gives a `response_format` request's
context its schema (`TextContext.json_schema`, prepared by gpt2-max's
tokenizer), installs a matcher compiled by MAX's xgrammar backend, and then
MAX's pipeline does the rest each step: it fills the context's row of a token
bitmask, samples with the bitmask sampler graph (the mask is applied inside
the sampler, so a seed draws from the same random stream), and advances the
matcher with the sampled token, one token a step.

`Options(grammar_engine="xgrammar")` takes the same path, not a copy of it:
the request gets the `response_format` the server's chat route makes
(`shims.internals.openai_response_format`), the context is built by the same
tokenizer, the matcher is built by the factory the server calls
(`shims.internals.xgrammar_backend`) from the context's own schema, and the
`Generator`'s pipeline is built with `enable_structured_output` so MAX
compiles and uses the bitmask sampler. So a schema, prompt and seed give the
server's tokens, greedy or sampled, and no token is fast-forwarded.

xgrammar, unlike llguidance, accepts any tokenization of the allowed text, so
its greedy path may spell `{"` as `{` then `"`; llguidance's canonical rule
would not. That is why the two engines' outputs differ, and why the in-process
default (llguidance, with fast-forward tokens) stays what it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from max.pipelines.context import TextContext

from ..json_schemas import loaded, prepare


def compile_json_schema(backend: Any, schema: str | dict[str, Any]) -> Any:
    """`schema` as the server compiles it, or ValueError with xgrammar's reason."""
    schema = prepare(loaded(schema), multiple_of=False)
    try:
        return backend.compile_json_schema(schema)
    except Exception as error:  # xgrammar raises RuntimeError or ValueError
        raise ValueError(f"json_schema cannot be compiled by xgrammar: {error}") from None


@dataclass
class XgrammarMask:
    """One request's view of the matcher MAX's pipeline steps, with `GrammarMask`'s interface."""

    context: TextContext
    forced: int = 0
    """Always 0: like the server, every token takes a step."""

    @classmethod
    def attach(cls, backend: Any, context: TextContext) -> XgrammarMask:
        """Installs a matcher for the context's schema, as the server's grammar gate does.

        The context's `json_schema` is the text the server's worker compiles
        (already prepared by the tokenizer); `backend` caches the compile that
        validated it.
        """
        context.set_matcher(backend.create_matcher(backend.compile_json_schema(context.json_schema)))
        return cls(context)

    def consume(self, token: int) -> None:
        """Nothing: MAX's pipeline advanced the matcher with the sampled token."""

    @property
    def finished(self) -> bool:
        """The grammar has taken its end-of-text token."""
        matcher = self.context.matcher
        return matcher is not None and matcher.is_stopped()

    def fast_forward(self, context: TextContext) -> list[int]:
        """Nothing: the server runs forced tokens one step each, and so does this mask."""
        return []
