"""MAX 26.7's scoring routes, `/v1/decisions` and `/v1/systemone`, which answer 500
to requests that are the client's to fix.

Both routes, on by default in `max serve`, render each question with the chat
template, score its answer labels in one prefill step of the text pipeline (which
serves this package's model unchanged) and turn the labels' log-probabilities into
option probabilities. Two requests their schema lets through end in a 500:

- `chat_template_kwargs` naming an argument the renderer passes itself (`tools`,
  `messages`, `self`, ...: `request_bodies.RENDERING_ARGUMENTS`) fails that call
  with a `TypeError`. `ChatFormat.encode` is wrapped to refuse it first with
  `InputError`, which the routes answer 400, in the words a chat body gets.
- A `temperature` the `/v1/decisions` schema allows (any positive number) so small
  that a label's log-probability divided by it overflows (5e-324) makes every scaled
  value -inf, and the softmax's `-inf - -inf` NaN, which the route counts a server
  fault. A softmax is the same whatever is added to all its inputs, so where MAX's
  `option_probabilities` is not finite it is taken again from the log-probabilities
  less their largest: the top label's is then 0 at any temperature, and a
  temperature that small gives it all the probability, the limit smaller
  temperatures approach. Every answer MAX gave stays as it was, bit for bit.

Installed by `shims.install` in the API process, where the routes run.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from .request_bodies import check_template_kwargs


def from_the_top(softmax: Callable[..., list[float]]) -> Callable[..., list[float]]:
    """`softmax` (MAX's `option_probabilities`), or where it is not finite, the same of
    the log-probabilities less their largest, which no temperature overflows."""
    @functools.wraps(softmax)
    def finite(label_log_probabilities: Sequence[float], temperature: float) -> list[float]:
        probabilities = softmax(label_log_probabilities, temperature)
        if all(math.isfinite(p) for p in probabilities):
            return probabilities
        top = max(label_log_probabilities)
        return softmax([value - top for value in label_log_probabilities], temperature)

    finite.from_the_top = True  # type: ignore[attr-defined]
    return finite


def checks_template_kwargs(encode: Callable[..., Any]) -> Callable[..., Any]:
    """`encode` (`ChatFormat.encode`), refusing `chat_template_kwargs` the renderer
    cannot take (`check_template_kwargs`) before it renders a question."""
    @functools.wraps(encode)
    async def checked(self: Any, tokenizer: Any, state: Any, items: Any,
                      chat_template_kwargs: dict[str, Any]) -> Any:
        check_template_kwargs(chat_template_kwargs)
        return await encode(self, tokenizer, state, items, chat_template_kwargs)

    checked.checks_template_kwargs = True  # type: ignore[attr-defined]
    return checked


def install() -> None:
    """Puts `from_the_top` in both of the routes' prompt formats, which look
    `option_probabilities` up as they score, and `checks_template_kwargs` on the chat
    format's `encode` (once). Their modules are private, so imported here."""
    from max.serve.router import _chat_format, _decider_format

    for module in (_chat_format, _decider_format):
        if not getattr(module.option_probabilities, "from_the_top", False):
            module.option_probabilities = from_the_top(module.option_probabilities)
    chat = _chat_format.ChatFormat
    if not getattr(chat.encode, "checks_template_kwargs", False):
        chat.encode = checks_template_kwargs(chat.encode)  # type: ignore[method-assign]
