"""Private MAX names and behaviours gpt2-max reads, each behind one function.

Every function here is a one-line reach into MAX 26.7 that has no public
equivalent; `tests/shims/test_internals.py` checks each still exists with the
meaning used here. Each imports its private name when called, never when this
module loads, so a MAX release that moved one fails the feature that reads it,
not the package's import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq
from max.driver import Device
from max.graph.quantization import QuantizationEncoding
from max.graph.weights import GGUFWeights
from max.pipelines.context import TokenBuffer
from max.pipelines.lib import MAXModelConfig


def row_seed_stride() -> int:
    """MAX's `generate` seeds row `i` of a batch with `seed + i * row_seed_stride()`;
    the in-process branches use the same rule, so a seed means the same thing."""
    from max.pipelines.lib.generate import _ROW_SEED_STRIDE

    return _ROW_SEED_STRIDE


def log_probabilities_heap_levels() -> int:
    """The heap depth MAX's `LogProbabilitiesMixin` builds its log-probabilities graph with."""
    from max.pipelines.lib.log_probabilities import _LOGPROBS_HEAP_LEVELS

    return _LOGPROBS_HEAP_LEVELS


def check_logprobs_count(count: int, field: str) -> None:
    """MAX's routes' check of a log-probabilities count against what its graph reports
    (raises `InputError`, a `ValueError`, naming `field`)."""
    from max.serve.router.openai_routes import _validate_logprobs_count

    _validate_logprobs_count(count, field)


def free_memory(devices: list[Device]) -> int:
    """Free memory on `devices` as MAX's memory estimator sees it (the host's, on the CPU)."""
    from max.pipelines.lib.memory_estimation import MemoryEstimator

    return MemoryEstimator._free_memory(devices)


def planner_config(planner: Any) -> Any:
    """The arch config a `PagedMemoryPlanner` plans for (it keeps it privately)."""
    return planner._config


def quantization_encoding(model_config: MAXModelConfig, default: str) -> str:
    """The encoding MAX resolves for `model_config` (from flags, file names, the default)."""
    from max.pipelines.lib.config.model_config import _select_quantization_encoding

    return _select_quantization_encoding(model_config, default)


def gguf_reader(weights: GGUFWeights) -> Any:
    """The `gguf.GGUFReader` MAX's `GGUFWeights` opened (it keeps the file mapped)."""
    assert isinstance(weights, GGUFWeights), type(weights)
    return weights._reader


def graph_value(tensor: Any) -> Any:
    """The graph value (tensor or buffer) a ModuleV3 graph input wraps.

    KV-cache inputs include buffers, which `TensorValue(...)` does not take.
    """
    return tensor._graph_value


def quantized_matmul_op(encoding: QuantizationEncoding) -> str:
    """MAX's CPU kernel for `x @ W.T` with `W` in `encoding`'s blocks, repacked."""
    return f"vroom_{encoding.name}_matmul"


def quantized_repack_op(encoding: QuantizationEncoding) -> str:
    """MAX's CPU kernel that repacks `encoding`'s blocks for `quantized_matmul_op`."""
    return f"vroom_{encoding.name}_repack_weights"


def processing_offset(tokens: TokenBuffer) -> int:
    """A token buffer's processing offset, which only the private field tells."""
    return tokens._processing_offset


def run_again(tokens: TokenBuffer, n: int) -> None:
    """Makes the last `n` tokens (appended with `update`, so counted as processed)
    active again, so the next step computes their KV entries."""
    tokens.rewind_processing(n)


def xgrammar_backend(tokenizer: Any) -> Any:
    """MAX's grammar backend for a pipeline `tokenizer`, built as `max serve` builds it.

    `StructuredOutputHelper.from_tokenizer` (the serving path) calls the same
    factory with the same vocabulary, stop tokens and compact JSON, so a
    schema compiled by it masks exactly what the server's masks.
    """
    from max.pipelines.lib.pipeline_variants.structured_output_backend import (
        make_grammar_backend,
    )

    return make_grammar_backend(
        "xgrammar",
        tokenizer.delegate,
        len(tokenizer.delegate),
        stop_token_ids=tokenizer.eos_token_ids,
    )


def openai_response_format(response_format: dict[str, Any]) -> Any:
    """The `TextGenerationResponseFormat` `max serve --enable-structured-output`
    makes of an OpenAI `response_format` (`json_object` becomes MAX's permissive
    object schema, `json_schema` its schema), by MAX's own route helper.

    Imported on first use: it lives in MAX's serving router, which the model
    worker and the in-process `Generator` have no other reason to load.
    """
    from max.serve.router.openai_routes import _create_response_format

    return _create_response_format(response_format, enable_response_format_schema=True)


def pipeline_model(pipeline: Any) -> Any:
    """A text pipeline's pipeline model (`None` for a pipeline that has none)."""
    return getattr(pipeline, "_pipeline_model", None)


def request_waiting(queue: Any) -> Callable[[], bool] | None:
    """A probe of whether a request waits in the model worker's request `queue` (a
    ZMQ pull socket): a zero-timeout poll of its socket, which takes nothing from
    it. `None` for a queue of another kind."""
    from max.serve.worker_interface._zmq_queue import ZmqPullSocket

    if not isinstance(queue, ZmqPullSocket):
        return None
    socket = queue._socket
    return lambda: bool(socket.poll(0, zmq.POLLIN))


def pipeline_sampler(pipeline: Any) -> tuple[Any, Any, Device]:
    """A text pipeline's model, its token sampler graph (the one without a grammar's
    bitmask) and the device that sampler runs on, which it keeps privately."""
    return pipeline_model(pipeline), pipeline._sampler_without_bitmask, pipeline._sampler_device


def replace_pipeline_sampler(pipeline: Any, sampler: Any) -> None:
    """Puts `sampler` where a text pipeline keeps its token sampler graph (the one
    without a grammar's bitmask), which it calls as `sampler(*graph_inputs)`."""
    pipeline._sampler_without_bitmask = sampler


def sampler_inputs(contexts: Any, device: Device) -> Any:
    """The per-row sampling tensors MAX's `FusedSamplingProcessor` gives its sampler
    (temperature, top-k, top-p, min-p, each row's seed for its next token)."""
    from max.pipelines.sampling.sampling_logits_processor import SamplerInputs

    return SamplerInputs.create(contexts, device)


def min_tokens_masks(contexts: Any, steps: int, device: Device, enabled: bool) -> Any:
    """MAX's end-of-text masks for `steps` steps from each row's current position
    (`None` when the sampler was built without `min_tokens`)."""
    from max.pipelines.sampling.sampling_logits_processor import _build_min_tokens_masks

    return _build_min_tokens_masks(contexts, steps, device, enabled)


def sample_logits(sampler: Any, logits: Any, generated: Any, inputs: Any, mask: Any) -> Any:
    """One call of MAX's sampler graph as its `FusedSamplingProcessor` makes it:
    (new tokens, generated tokens so far, next seed)."""
    from max.pipelines.sampling.sampling_logits_processor import _sample_logits

    return _sample_logits(sampler, logits, generated, inputs, min_tokens_mask=mask)


def row_seed(context: Any) -> int:
    """The Philox key MAX's sampler gives `context`'s row: its seed advanced by the
    number of tokens it holds, so the key of each later token is this plus one."""
    from max.pipelines.sampling.seeds import request_row_seed

    return request_row_seed(context)
