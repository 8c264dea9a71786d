"""GPT-2's tokenizer: request validation and a default chat template.

A prompt given as token ids, and a request's stop token ids, are checked against
the model's vocabulary here, before it is queued: an id outside `[0, vocab_size)`
would index past the embedding table inside the graph, or past the logits where
`min_tokens` masks stop tokens, and take the model worker down, so it is answered
with a 400 (`InputError`) instead. So is a request for echoed
log-probabilities from a server started without `--enable-echo`: the graph then
returns only last-position logits and the step would fail. An empty prompt (`""`,
`[]`), which MAX refuses with a `ValueError` its routes answer as a bare "Value
error.", is answered 400 saying so, as is a request for no tokens (`max_tokens` 0,
which MAX answers with one), and so is each check MAX's context makes of a request
(`min_tokens` past the window), whose `ValueError` the routes answer the same way.
A request's `stop_token_ids` stop it under `ignore_eos` too (`create_eos_tracker`),
and a `top_k` past the vocabulary, which would stop the worker, is cut to it. A
request echoing its prompt's log-probabilities reads nothing from the prefix cache,
whose hits would leave the cached tokens without theirs. A `min_tokens` holds back only
tokens that would end the request (none under `ignore_eos` without stop ids, where MAX's
empty mask stopped the worker), and `generation_config.json`'s `min_new_tokens`, which
the client never sent, gives way to the request's room and to a `response_format`. A
checkpoint whose `generation_config.json` sets sampling defaults MAX would refuse in
every request that leaves them unset, or could not pass to the model worker, or which
transformers cannot read (MAX drops it whole), is refused at load, as are end-of-text
ids outside the vocabulary.

A `response_format` JSON schema (served with `--enable-structured-output`,
which `gpt2_max.shims.structured_output` lets through on the CPU) goes through
`gpt2_max.json_schemas.prepare` here, in the API process: a schema with no
finite value is answered 400 naming its cycle before it is queued, and the
schema MAX's grammar engine compiles has its numbers bounded by the rule the
in-process generator follows too.

GPT-2 was never trained on chats and ships no chat template; MAX answers a chat
request to such a model with 400. `PLAIN_CHAT_TEMPLATE` renders a conversation
as plain `Role: content` lines ending in `Assistant:`, which a base model can
continue. It is used only for chat requests: completions and `max generate`
still see a template-less tokenizer and send the raw prompt. A template in the
checkpoint or `--chat-template` takes precedence. A chat the template refuses
(its `raise_exception`: roles that do not alternate, say) is answered 400 with the
template's reason, where MAX's routes would answer 500.

Exact `stop` strings for this tokenizer's requests under `max serve` are
`gpt2_max.shims.stop_strings`' business, installed when the architecture is
registered.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import TemplateError, TemplateSyntaxError
from max.pipelines.context import EOSTracker, TextContext
from max.pipelines.context.exceptions import InputError
from max.pipelines.context.sampling_params import SamplingParamsInput
from max.pipelines.lib import PipelineConfig, TextTokenizer
from max.pipelines.modeling.types import (
    TextGenerationRequest,
    TextGenerationRequestMessage,
    TextGenerationRequestTool,
)
from transformers import GenerationConfig, PreTrainedTokenizerBase

from .json_schemas import SchemaError, prepare
from .model_config import usable_vocab_size
from .shims.request_bodies import (
    CheckedSamplingParams,
    ClientMinTokens,
    ClientStopTokenIds,
    is_int64,
    refusal,
    unreadable,
)
from .weights.files import TOKENIZER_FILES, tokenizer_files_named
from .weights.schema import CheckpointError

INTEGER_DEFAULTS = ("top_k", "max_new_tokens", "min_new_tokens")
"""`generation_config.json`'s counts, which MAX's model worker takes as 64-bit integers,
as it takes `eos_token_id` (one or a list)."""

TOKENIZER_DIR = Path(__file__).parent / "gpt2_tokenizer"
"""The real GPT-2 tokenizer, vendored so nothing needs the network."""


def copy_tokenizer(folder: Path) -> None:
    """Puts the vendored GPT-2 tokenizer files into `folder`."""
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / name, folder / name)


PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class GPT2TextTokenizer(TextTokenizer):
    """`TextTokenizer` that validates token ids and renders chats without a template."""

    def __init__(
        self, model_path: str, pipeline_config: PipelineConfig, **kwargs: Any
    ) -> None:
        with tokenizer_files_named(model_path):
            super().__init__(model_path, pipeline_config, **kwargs)
        vocab_size = pipeline_config.model.huggingface_config.vocab_size
        self.valid_token_ids = usable_vocab_size(vocab_size, self.tokenizer_vocab_size)
        self.echo_enabled = pipeline_config.model.enable_echo
        if outside := sorted(i for i in self.eos_token_ids if not 0 <= i < vocab_size):
            raise CheckpointError(
                f"the model's end-of-text token ids {outside} lie outside its vocabulary "
                f"of {vocab_size} (config.json vocab_size); MAX takes them from the "
                "tokenizer and the eos_token_id of config.json and generation_config.json. "
                "A request's min_tokens masks them in the logits, which stops the model "
                "worker: correct the file that names them."
            )
        self._check_sampling_defaults(pipeline_config)

    def _check_sampling_defaults(self, pipeline_config: PipelineConfig) -> None:
        """Refuses a `generation_config.json` whose defaults MAX would refuse or could
        not carry, or which it could not read at all.

        MAX puts the defaults into every request that leaves them unset and checks
        them there: a `temperature` of -1, say, answered every such request 400
        naming a value the client never sent, and a `min_new_tokens` past the window
        refused every request, each as the client's fault. A count given as a float
        (`2.0`) or past 64 bits passed that check, and MAX's queue to the model worker
        refused it there, which stopped the worker (500, then no server); a stop id
        not an integer answered every request 400. A file transformers refuses
        (`num_return_sequences` 2 beside greedy defaults, JSON with a trailing comma)
        MAX drops whole, with its end-of-text ids, logging it only at debug; that is
        checked for a checkpoint folder (a hub id's file is read by MAX alone).
        """
        model = pipeline_config.model
        file = Path(model.model_path, model.subfolder or "", "generation_config.json")
        if file.is_file():
            try:
                GenerationConfig.from_pretrained(file.parent)
            except Exception as error:  # MAX's own load catches all of them
                raise CheckpointError(
                    f"{file} cannot be read ({str(error).rstrip('.')}). MAX would "
                    "serve as if it were not there, without its end-of-text ids and "
                    "sampling defaults: correct or remove it."
                ) from None
        defaults = model.sampling_params_defaults
        try:
            ids = defaults.eos_token_id  # MAX drops one not an int or a list unread
            counts = [(name, getattr(defaults, name)) for name in INTEGER_DEFAULTS]
            counts += [("eos_token_id", i) for i in (ids if isinstance(ids, list) else [ids])]
            for name, value in counts:
                if value is not None and not is_int64(value):
                    raise ValueError(f"{name} must be a 64-bit integer, was {value!r}")
            # The routes' own check, which a request leaving them unset would meet.
            params = CheckedSamplingParams.from_input_and_generation_config(
                SamplingParamsInput(), defaults)
            if self.max_length and params.min_new_tokens >= self.max_length:
                raise ValueError(f"min_new_tokens ({params.min_new_tokens}) leaves no room "
                                 f"for a prompt in the window of {self.max_length} tokens")
        except (ValueError, TypeError) as error:
            named = ", ".join(f"{k}={v!r}" for k, v in defaults.values_to_update.items())
            raise CheckpointError(
                f"generation_config.json sets sampling defaults ({named}) that MAX refuses "
                f"({str(error).rstrip('.')}). Every request that leaves them unset would be "
                "refused: correct or remove the field."
            ) from None

    async def new_context(self, request: TextGenerationRequest) -> TextContext:
        if request.echo and request.logprobs and not self.echo_enabled:
            raise InputError(
                "echo with logprobs needs the logits of every prompt token; "
                "start the server with --enable-echo to serve it."
            )
        if request.prompt is not None and len(request.prompt) == 0:
            raise InputError("prompt is empty: give at least one token or character.")
        if request.sampling_params.max_new_tokens == 0:
            raise InputError(
                "max_tokens must be at least 1, was 0: a request's first step always "
                "yields a token (to score a prompt with echo, ask for 1 and drop it)."
            )
        try:
            request = self._with_prepared_schema(self._top_k_cut(self._scored_alone(request)))
            request, checkpoint_min = self._checkpoint_min_apart(request)
            context = await super().new_context(request)
        except ValueError as error:
            # MAX's checks of this request (`min_tokens` past the window), which the
            # routes would answer "Value error." without saying which.
            raise refusal(error) from None
        except RecursionError as error:
            # MAX's `json.dumps` of a `dkv_cache_hint` nested just under the depth the
            # body parser refuses (the stack is deeper here): a 500.
            raise unreadable(error, "the request") from None
        self._check_ids("prompt", context.tokens.prompt)
        self._check_ids("stop", self._own_stop_ids(request))
        self._fit_min_tokens(context, checkpoint_min, request.response_format is not None)
        return context

    @staticmethod
    def _checkpoint_min_apart(request: TextGenerationRequest) -> tuple[TextGenerationRequest, int]:
        """`request` without a `min_new_tokens` MAX took from `generation_config.json`
        (the client sent none: not `ClientMinTokens`), and that count, which
        `_fit_min_tokens` gives back where the request can meet it. MAX's context
        refuses a count past the request's room, which would answer a client 400 for a
        `min_tokens` it never sent. The client's count goes on as a plain `int`, which
        MAX's queue to the model worker can serialize (its encoder recursed on the
        subclass)."""
        count = request.sampling_params.min_new_tokens
        if isinstance(count, ClientMinTokens):  # 0 too: the mark must not reach the queue
            kept, checkpoint = int(count), 0
        elif count:
            kept, checkpoint = 0, count
        else:
            return request, 0
        params = dataclasses.replace(request.sampling_params, min_new_tokens=kept)
        return dataclasses.replace(request, sampling_params=params), checkpoint

    @staticmethod
    def _fit_min_tokens(context: TextContext, checkpoint_min: int, constrained: bool) -> None:
        """Sets the context's `min_tokens` to what its tokens can be held to.

        - The checkpoint's count (`_checkpoint_min_apart`), cut to the request's room
          (`max_tokens`, the window), and none beside a `response_format`: once the
          schema's value is complete the grammar allows only its end, which the count
          would hold back, and MAX then drops the grammar (the answer was `false!`
          and free text). A client's count there is refused at the route.
        - None where no token ends the request (`ignore_eos` and no `stop_token_ids`):
          MAX's mask of its end tokens then comes out of the wrong shape and the model
          worker stopped (500 to every request in flight). Stop strings still wait for
          the request's own count (`shims.stop_strings` reads the request).
        """
        count = context.min_tokens
        if checkpoint_min and not constrained:
            count = min(checkpoint_min, context.max_length - context.tokens.prompt_length)
        if not context.eos_tracker.eos_token_ids:
            count = 0
        if count != context.min_tokens:
            context.sampling_params = dataclasses.replace(
                context.sampling_params, min_new_tokens=count)

    def _own_stop_ids(self, request: TextGenerationRequest) -> list[int]:
        """The request's `stop_token_ids`: all of them where the client sent them
        (`ClientStopTokenIds`), else those but the model's EOS, which MAX puts there
        from the checkpoint's `generation_config.json` when the client sent none."""
        ids = request.sampling_params.stop_token_ids or []
        if isinstance(ids, ClientStopTokenIds):
            return list(ids)
        return [i for i in ids if i not in self.eos_token_ids]

    @staticmethod
    def _scored_alone(request: TextGenerationRequest) -> TextGenerationRequest:
        """`request` with a prefix-cache salt of its own where it echoes its prompt's
        log-probabilities: MAX skips the prompt's pages the cache holds (the same prompt
        asked before, or another sharing its first pages), and echo has an entry for
        each token computed, so the answer lacked the cached tokens'. vLLM reads no
        cache for such a request either."""
        if not (request.echo and request.logprobs):
            return request
        return dataclasses.replace(
            request, cache_salt=f"{request.cache_salt or ''} echo {uuid.uuid4().hex}")

    def _top_k_cut(self, request: TextGenerationRequest) -> TextGenerationRequest:
        """`request` with a `top_k` past the vocabulary cut to it, which keeps the same
        tokens (all of them): MAX's sampler sizes its work by a batch's largest `top_k`,
        and one of 2**31 beside a `top_p` or `min_p` stopped the model worker."""
        params = request.sampling_params
        if params.top_k <= self.valid_token_ids:
            return request
        return dataclasses.replace(
            request, sampling_params=dataclasses.replace(params, top_k=self.valid_token_ids))

    def _check_ids(self, what: str, ids: Any) -> None:
        """Raises `InputError` naming the first of `ids` outside the vocabulary: in a
        prompt it would index past the embedding table; as a stop token, the model worker
        masks it in the logits under `min_tokens` (one past int32 stops the worker)."""
        try:
            array = np.asarray(ids, dtype=np.int64)
        except OverflowError:  # past int64: the routes refuse it first, the Generator not
            array = np.asarray([min(max(int(i), -1), self.valid_token_ids) for i in ids])
        (invalid,) = np.nonzero((array < 0) | (array >= self.valid_token_ids))
        if invalid.size:
            first = int(invalid[0])
            raise InputError(
                f"{what} token id {int(ids[first])} at position {first} is "
                f"outside the vocabulary [0, {self.valid_token_ids})."
            )

    async def create_eos_tracker(self, request: TextGenerationRequest) -> EOSTracker:
        """MAX's tracker, keeping the client's own stop tokens under `ignore_eos`: MAX
        drops them with the model's EOS, so a client that asked to run past EOS and stop
        at its own tokens got tokens past them (vLLM stops there, as here). The model's
        EOS stays dropped, which MAX also lists among the stop tokens
        (`_own_stop_ids`)."""
        tracker = await super().create_eos_tracker(request)
        own = self._own_stop_ids(request)
        if not (request.sampling_params.ignore_eos and own):
            return tracker
        return EOSTracker(
            eos_token_ids=tracker.eos_token_ids | set(own),
            eos_sequences=tracker.eos_sequences,
            eos_stop_strings=tracker.eos_stop_strings,
        )

    @staticmethod
    def _with_prepared_schema(request: TextGenerationRequest) -> TextGenerationRequest:
        """`request` with its response-format schema through `json_schemas.prepare`."""
        response_format = request.response_format
        if response_format is None or response_format.json_schema is None:
            return request
        try:
            schema = prepare(response_format.json_schema, multiple_of=False)
        except SchemaError as error:
            raise InputError(str(error)) from None
        return dataclasses.replace(
            request, response_format=dataclasses.replace(response_format, json_schema=schema)
        )

    def apply_chat_template(
        self,
        messages: list[TextGenerationRequestMessage],
        tools: list[TextGenerationRequestTool] | None,
        **chat_template_options: Any,
    ) -> str:
        """The chat as the template renders it; a conversation or `chat_template_kwargs`
        the template refuses (its `raise_exception`, a variable of the wrong type) is
        refused 400 with the template's reason, where MAX's routes would answer 500 or
        "Invalid JSON."."""
        try:
            # MAX sets a `--chat-template` on the delegate, so this sees it too.
            if self.delegate.chat_template:
                return super().apply_chat_template(messages, tools, **chat_template_options)
            return PreTrainedTokenizerBase.apply_chat_template(
                self.delegate,
                [message.flatten_content() for message in messages],
                chat_template=PLAIN_CHAT_TEMPLATE,
                tokenize=False,
                tools=tools,
                **{"add_generation_prompt": True, **chat_template_options},
            )
        except (TemplateError, TypeError, ValueError) as error:
            # MAX wraps a `--chat-template`'s error in a ValueError of its own.
            reason = error.__cause__ or error
            if isinstance(reason, TemplateSyntaxError):
                raise  # the server's template is broken, whatever the chat: not a 400
            refused = ValueError(f"the chat template cannot render this chat: {reason}")
            raise refusal(refused) from error
