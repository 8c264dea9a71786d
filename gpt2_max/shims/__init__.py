"""Every place gpt2-max leans on MAX beyond its documented API, in one package.

MAX's Python API moves between releases, and a plugin has to reach past it in a
few places: a private helper, an internal kernel name, a serving-layer bug to
work around. Each such reach lives here, in a module that says what it leans on
and why, so nothing else in the package imports a private MAX name:

- `internals`: private MAX names and behaviours read directly (the memory
  estimator's free-memory query, the quantization-encoding resolver, the GGUF
  reader under `GGUFWeights`, the log-probabilities graph's heap depth, the
  quantized CPU kernels' op names, the row-seed stride of MAX's generate loop, a
  graph tensor's value, a token buffer's processing window, the server's grammar
  backend factory, the chat route's conversion of an OpenAI `response_format`,
  the sampler's inputs, seeds, masks and call as the text pipeline makes them,
  and a poll of the model worker's request queue).
- `request_bodies`: a completions body with no prompt, or with several
  prompts and `stream`, and an integer past int64 (MAX 26.7 answers 500, or its
  model worker stops), a number that is not finite, a body setting a field MAX's
  routes drop (`n`, `best_of`, `logit_bias`, `suffix`; in a chat audio output,
  web search, `functions`, `top_logprobs` without `logprobs`, a content part that
  is not text), and a chat `tool_choice`
  requiring a call that no tool parser forces, answered 400 naming the cause; so
  are a body that is not UTF-8, a sampling value out of its range and an unknown
  model name, which MAX answers "Value error.". `/v1/embeddings`, which MAX
  sends to the text worker and answers 500, gets 404; `seed` 0 and a chat's
  `top_logprobs` 0, which MAX reads as none, are kept, and a chat's alternatives
  are as many as it asked for.
- `decisions`: MAX's scoring routes (`/v1/decisions`, `/v1/systemone`), which
  answer 500 to `chat_template_kwargs` naming what their renderer passes itself, and
  `/v1/decisions` to a temperature so small the labels' softmax overflows: the first
  refused 400, the second scored from the top label's log-probability down.
- `min_p`: a request's `min_p` on the CPU, whose sampling kernel in MAX 26.7
  takes it and draws as if it were 0, applied in MAX's sampler graph before it.
- `echo_answers`: completions' `echo` as OpenAI answers it (the prompt's text,
  and its first token's `null` log-probability, which MAX leaves out, so every
  later entry sat a token early).
- `echo_penalties`: penalties on a server that also returns every prompt
  position's logits (`--enable-echo`), whose sampler graph MAX 26.7 cannot build.
- `weight_files`: a damaged local weight file named before MAX 26.7 reads its
  header and refuses the checkpoint without naming the file; a folder saved in
  float16 or bfloat16, in which MAX finds no weights for a float32 graph, given
  its files by name.
- `answer_text`: an answer's text its own tokens' under `max serve`, which MAX
  wrote after the prompt's whole text where a prompt of token ids ends inside a
  character.
- `stop_strings`: exact `stop` strings under `max serve`, a patch of MAX's
  serving pipeline on the releases that cut stop strings wrongly.
- `structured_output`: `--enable-structured-output` on the CPU for this
  package's pipelines, which MAX 26.7 refuses for every model on the CPU.
- `fast_forward`: opt-in fast-forward tokens under `max serve`
  (`GPT2_MAX_FAST_FORWARD=1`), a `TextContext` subclass registered as the
  architecture's context type.
- `shared_sampler`: the text pipeline's token sampler offered to a GPT-2
  pipeline model, whose extensions may put another in its place
  (`sampler_for`: `gpt2_max.sampler`'s on the CPU), then handed to a model
  that asks for it (`takes`, `hand_over`), whose decode bursts
  (`gpt2_max.bursts`) sample with it.
- `tool_calls`: the llama tool parser's search for JSON in an answer, and the
  chat route's conformance check of an answer against the client's schema (for
  its log), each of which a request could make run for hours on the API's event
  loop with a regular expression.
- `waiting_requests`: whether a request waits in MAX's scheduler's queue, told
  to a pipeline model that asks, whose decode bursts end when
  one does. Both hook the `__init__` of the MAX class that holds what they hand
  over, one way (`patching.after_init`).

(How MAX's CPU threads are scheduled is a speed policy, not a reach past MAX's
API: `gpt2_max.cpu_runtime`.)

One gate for all of them (`release.CHECKED_AGAINST`): `install` puts every
shim in place on the MAX releases they were checked against and none on any
other, where the package still imports and serves on MAX's own behaviour, with
the features the shims carry off and named in one warning. `tests/shims/` assert
that every leaned-on name and behaviour is still there, and that the installed
MAX is one of those releases, so a new MAX release fails those tests by name
before it can quietly change what a user gets.

`install` is called once, by `gpt2_max.model`, the module both of `max serve`'s
processes import (the API process through `gpt2_max.arch`; the model worker
unpickles the pipeline model's class, and never imports the architecture).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

from ..names import PACKAGE
from . import (
    answer_text,
    decisions,
    echo_answers,
    echo_penalties,
    min_p,
    release,
    request_bodies,
    shared_sampler,
    stop_strings,
    structured_output,
    tool_calls,
    waiting_requests,
    weight_files,
)

logger = logging.getLogger("max.pipelines")

CARRIED = (
    "exact stop strings (MAX's own matching applies)",
    "an answer's text alone after a prompt of token ids that ends inside a character",
    "structured output on the CPU",
    "400 naming the cause for an empty completions prompt, a dropped field, an integer "
    "past int64, a number not finite, a tool call no parser forces, a sampling value out "
    "of range or an unknown model",
    "400 for chat_template_kwargs the decisions routes' renderer cannot take, and their "
    "probabilities at any temperature",
    "min_p on the CPU",
    "penalties beside --enable-echo",
    "echo's prompt text and its first token's null log-probability",
    "named damaged weight files, checkpoint folders saved in float16 or bfloat16",
    "decode bursts",
    "the CPU's sampler of plain rows",
    "fast-forward tokens",
    "tool calls and answers to a schema read without a regular expression that can "
    "stall the server",
)
"""What a user loses on a MAX release the shims were not checked against."""


@functools.cache
def _warn_unchecked(version: str) -> None:
    logger.warning(
        f"{PACKAGE}: MAX {version} is not a release its shims were checked against "
        f"({', '.join(release.CHECKED_AGAINST)}); serving on MAX's own behaviour, "
        f"without: {'; '.join(CARRIED)}."
    )


def install(
    tokenizer_type: type,
    check_weight_files: Callable[[list[Path]], None],
    half_precision: Callable[[list[Path]], bool],
) -> bool:
    """Installs every shim for `tokenizer_type`'s requests on a checked MAX release and
    returns True; on another release installs none, warns once, returns False.
    `check_weight_files` raises naming a damaged weight file; `half_precision` says
    whether safetensors files hold a model saved in float16 or bfloat16
    (`weight_files`).

    Idempotent, and safe for several architectures (or copies of this package)
    in one process: each adds its own tokenizer type.
    """
    if not release.checked():
        _warn_unchecked(release.max_version())
        return False
    request_bodies.install()
    echo_answers.install()
    decisions.install()
    min_p.install()
    echo_penalties.install()
    weight_files.install(tokenizer_type, check_weight_files, half_precision)
    stop_strings.install(tokenizer_type)
    answer_text.install(tokenizer_type)
    structured_output.install(tokenizer_type)
    shared_sampler.install()
    waiting_requests.install()
    tool_calls.install()
    return True
