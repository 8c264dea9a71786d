"""What `gpt2_max.shims` leans on in MAX is still there and still means the same.

These fail, by name, on a MAX release that moved one of them: the place to
look is the matching function in `gpt2_max/shims/internals.py`.
"""

from __future__ import annotations

import inspect
import queue
import time

import numpy as np
import pytest
from max.driver import CPU
from max.experimental.tensor import Tensor
from max.graph.ops import quantized as max_quantized
from max.graph.quantization import QuantizationEncoding
from max.pipelines.context import TextContext, TokenBuffer
from max.pipelines.lib import generate as max_generate

from gpt2_max import shims
from gpt2_max.shims import internals, release

pytestmark = pytest.mark.tier("unit")


def test_the_installed_max_is_a_release_the_shims_were_checked_against() -> None:
    """A new MAX release: re-check every shim here, then add it to `CHECKED_AGAINST`."""
    assert release.checked(), release.max_version()
    assert release.checked("26.7.0") and not release.checked("26.8.0")


def test_free_memory_reads_the_hosts_memory_on_the_cpu() -> None:
    assert internals.free_memory([CPU()]) > 2**28


def test_the_memory_planner_keeps_its_arch_config() -> None:
    from max.pipelines.kv_cache.memory_planner import PagedMemoryPlanner

    sources = [inspect.getsource(cls.__init__) for cls in PagedMemoryPlanner.__mro__[:2]]
    assert any("self._config = config" in source for source in sources)

    planner = PagedMemoryPlanner.__new__(PagedMemoryPlanner)
    planner._config = config = object()
    assert internals.planner_config(planner) is config


def test_the_encoding_resolver_takes_the_config_and_the_default() -> None:
    from max.pipelines.lib.config.model_config import _select_quantization_encoding

    parameters = inspect.signature(_select_quantization_encoding).parameters
    assert list(parameters) == ["config", "default_encoding"]


def test_generate_seeds_rows_with_the_stride() -> None:
    assert internals.row_seed_stride() == 1 << 32
    assert "row * _ROW_SEED_STRIDE" in inspect.getsource(max_generate)


def test_the_quantized_kernels_are_the_ones_maxs_qmatmul_stages() -> None:
    source = inspect.getsource(max_quantized)
    encoding = QuantizationEncoding.Q4_K
    assert internals.quantized_repack_op(encoding) == "vroom_q4_k_repack_weights"
    assert 'f"vroom_{quantization_encoding_str}_repack_weights"' in source
    assert internals.quantized_matmul_op(encoding) == "vroom_q4_k_matmul"
    assert "_matmul" in source and "vroom" in source


def test_module_v3_tensors_wrap_their_graph_value() -> None:
    assert "_graph_value" in inspect.getsource(Tensor)


def test_processing_offset_and_run_again_move_the_active_window() -> None:
    context = TextContext(max_length=64, tokens=TokenBuffer(np.arange(6, dtype=np.int64)))
    assert internals.processing_offset(context.tokens) == 0
    context.apply_processing_offset(2)
    assert internals.processing_offset(context.tokens) == 2

    context = TextContext(max_length=64, tokens=TokenBuffer(np.arange(6, dtype=np.int64)))
    context.update(6)  # the prompt ran; token 6 sampled, to run next step
    in_cache = context.tokens.processed_length
    for token in (7, 8):  # forced tokens appended: each counts the one before as processed
        context.update(token)
    assert context.tokens.active.tolist() == [8]
    internals.run_again(context.tokens, context.tokens.processed_length - in_cache)
    assert context.tokens.active.tolist() == [6, 7, 8]
    assert context.tokens.processed_length == in_cache == 6


def test_the_stop_patch_serves_several_tokenizer_types_and_patches_once() -> None:
    from max.serve.pipelines.llm import TokenGeneratorPipeline

    from gpt2_max.shims import stop_strings

    class First:
        pass

    class Second:
        pass

    def check(paths):
        pass

    def half_precision(paths):
        return False

    shims.install(First, check, half_precision)
    patched = TokenGeneratorPipeline.next_token_chunk
    shims.install(Second, check, half_precision)
    shims.install(First, check, half_precision)
    assert TokenGeneratorPipeline.next_token_chunk is patched
    assert patched.cuts_at_stops
    assert stop_strings._TOKENIZER_TYPES.count(First) == 1
    assert Second in stop_strings._TOKENIZER_TYPES


def test_the_server_builds_its_grammar_backend_as_xgrammar_backend_does() -> None:
    """`xgrammar_backend` gives the Generator the server's masks only while MAX's
    serving path calls the same factory with the same vocabulary and stop tokens."""
    from max.pipelines.lib.pipeline_variants.utils import StructuredOutputHelper

    source = inspect.getsource(StructuredOutputHelper.from_tokenizer)
    for part in ("vocab_size = len(tokenizer_delegate)", "make_grammar_backend(",
                 "stop_token_ids=tokenizer.eos_token_ids", "any_whitespace=bool(any_whitespace)"):
        assert part in source, part
    assert "xgrammar" in inspect.getsource(internals.xgrammar_backend)


def test_openai_response_format_is_the_servers_conversion() -> None:
    """The chat route turns `response_format` into a request's format with this helper
    (flag on), so the `Generator` given its result asks what a client asks the server."""
    from max.serve.router import openai_routes

    assert ("_create_response_format(\n            completion_request.response_format,\n"
            "            enable_response_format_schema=pipeline_config.sampling."
            "enable_structured_output,") in inspect.getsource(openai_routes)
    json_object = internals.openai_response_format({"type": "json_object"})
    assert (json_object.type, json_object.json_schema) == ("json_schema", {"type": "object"})
    assert json_object.grammar_enforced and json_object.requires_structured_output_flag
    schema = {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}
    named = internals.openai_response_format(
        {"type": "json_schema", "json_schema": {"name": "flags", "schema": schema}}
    )
    assert (named.type, named.json_schema, named.grammar_enforced) == ("json_schema", schema, True)


def test_the_text_pipeline_keeps_its_model_and_sampler_where_the_burst_shim_reads_them():
    from max.pipelines.lib.pipeline_variants.text_generation import TextGenerationPipeline

    source = inspect.getsource(TextGenerationPipeline)  # the class's own text, unpatched
    names = ("self._pipeline_model =", "self._sampler_without_bitmask:", "self._sampler_device:")
    for name in names:
        assert name in source, name


def test_the_sampler_helpers_take_what_the_fused_sampling_processor_passes():
    from max.pipelines.sampling import sampling_logits_processor as fused

    assert list(inspect.signature(fused._sample_logits).parameters) == [
        "sampler", "logits", "prev_tokens", "sampler_inputs",
        "logit_offsets", "bitmask", "min_tokens_mask", "penalty_inputs",
    ]
    assert list(inspect.signature(fused._build_min_tokens_masks).parameters) == [
        "batch", "num_steps", "device", "enable_min_tokens",
    ]
    source = inspect.getsource(fused.FusedSamplingProcessor)
    assert "SamplerInputs.create(context_batch, device)" in source
    assert "request_row_seed(context)" in inspect.getsource(fused.SamplerInputs.create)


def test_request_waiting_looks_at_the_workers_queue_without_taking():
    from max.serve.worker_interface._zmq_queue import ZmqConfig

    config = ZmqConfig[list[int]](list[int])
    pull, push = config.pull(), config.push()
    waiting = internals.request_waiting(pull)
    assert waiting is not None and not waiting()
    push.put([1, 2, 3])
    for _ in range(1000):  # the message crosses ZMQ's I/O thread
        if waiting():
            break
        time.sleep(0.001)
    assert waiting() and waiting()  # looking takes nothing ...
    assert pull.get_nowait() == [1, 2, 3]  # ... the scheduler's pull does
    assert not waiting()
    assert internals.request_waiting(queue.Queue()) is None


def test_the_scheduler_keeps_what_the_request_watch_reads():
    from max.serve.scheduler.text_generation_scheduler import TokenGenerationScheduler

    source = inspect.getsource(TokenGenerationScheduler)  # the class's own text, unpatched
    for name in ("self.pipeline = pipeline", "self.request_queue = request_queue",
                 "self.max_pending_requests = max_pending_requests", "self.batch_constructor =",
                 "self._retrieve_pending_requests()\n", "self.batch_constructor.all_ce_reqs"):
        assert name in source, name
    assert internals.pipeline_model(object()) is None


def test_the_log_probabilities_graph_is_built_at_the_mixins_heap_depth() -> None:
    from max.pipelines.lib.log_probabilities import LogProbabilitiesMixin

    assert isinstance(internals.log_probabilities_heap_levels(), int)
    assert "levels=_LOGPROBS_HEAP_LEVELS" in inspect.getsource(LogProbabilitiesMixin.__init__)


def test_a_log_probabilities_count_is_checked_by_the_routes_rule() -> None:
    internals.check_logprobs_count(0, "logprobs")
    internals.check_logprobs_count(2 ** internals.log_probabilities_heap_levels() - 1, "x")
    with pytest.raises(ValueError, match=r"`top_logprobs` must be in \[0, 7\], was 8"):
        internals.check_logprobs_count(8, "top_logprobs")
    with pytest.raises(ValueError, match="was -1"):
        internals.check_logprobs_count(-1, "logprobs")
