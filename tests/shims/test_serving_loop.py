"""Why fast-forward tokens under `max serve` go through `advance_fsm`, not a later hook.

The in-process `Generator` appends the tokens a grammar forces to a context
between steps, so the next step runs them with the sampled token. Under `max
serve` the architecture's batch processor comes too late for that: the
scheduler claims KV pages for the length a context has when it is scheduled,
the pipeline then builds the step's KV inputs and grammar bitmask before the
batch processor sees the contexts, and after the step exactly one sampled
token is appended to each. So `shims.fast_forward` appends forced tokens in
the context's own `advance_fsm`, which MAX calls after the step and before the
next allocation (`tests/shims/test_fast_forward.py`).
Each test pins one of those facts with MAX's own objects (no graph is
compiled); one that fails means MAX changed, and a simpler hook may then do.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef
from max.nn.kv_cache.cache_params import MHAKVCacheParams
from max.pipelines.context import TextContext, TokenBuffer
from max.pipelines.kv_cache import PagedKVCacheManager
from max.pipelines.lib.pipeline_variants.text_generation import TextGenerationPipeline
from max.pipelines.lib.pipeline_variants.utils import update_context_and_prepare_responses

from gpt2_max.shims.internals import run_again

pytestmark = pytest.mark.tier("unit")

PAGE = 4


def new_context(prompt_length: int) -> TextContext:
    return TextContext(max_length=4 * PAGE, tokens=TokenBuffer(np.arange(prompt_length)))


@pytest.fixture
def kv_cache() -> PagedKVCacheManager:
    """A paged KV cache of 8 pages of `PAGE` tokens on the CPU, as the scheduler holds one."""
    params = MHAKVCacheParams(dtype=DType.float32, head_dim=4, num_layers=1, n_kv_heads=1,
                              devices=[DeviceRef.CPU()], page_size=PAGE)
    return PagedKVCacheManager(params, InferenceSession(devices=[CPU()]), total_num_pages=8,
                               max_batch_size=1)


def test_a_step_appends_one_sampled_token_per_context() -> None:
    """`max/pipelines/lib/pipeline_variants/utils.py:170-173`: even offered two
    tokens for a row, the step commits the first and nothing else."""
    context = new_context(3)
    update_context_and_prepare_responses(np.array([[7, 8]], np.int32), [context])
    assert context.tokens.generated.tolist() == [7]
    assert len(context.tokens) == 4


def test_kv_pages_cover_the_length_a_context_had_when_allocated(kv_cache) -> None:
    """A context given two forced tokens after the scheduler's `alloc`
    (`text_batch_constructor.py:1450`) has no pages for them, and MAX refuses to
    build its KV inputs; given them before `alloc`, the same step would run them."""
    context = new_context(PAGE - 1)
    kv_cache.claim(context)
    kv_cache.alloc(context)
    kv_cache.runtime_inputs([[context]])  # the prompt alone fits its page
    for token in (11, 12):  # what a fast-forward hook would add, after alloc
        context.update(token)
    run_again(context.tokens, 2)
    with pytest.raises(ValueError, match="does not have sufficient blocks"):
        kv_cache.runtime_inputs([[context]])
    kv_cache.alloc(context)  # only a new alloc covers them
    kv_cache.runtime_inputs([[context]])


def test_the_pipeline_builds_kv_inputs_and_bitmask_before_the_batch_processor() -> None:
    """`text_generation.py:508-517`: the bitmask for each context's next position
    and the KV inputs exist before the architecture's batch processor
    (`prepare_initial_token_inputs`) is handed the batch, so tokens it added
    would run without KV pages and under a mask for the wrong position."""
    source = inspect.getsource(TextGenerationPipeline.prepare_batch)
    order = [source.index(call) for call in (
        "self.update_for_structured_output(", "self._kv_manager.runtime_inputs(",
        "self._pipeline_model.prepare_initial_token_inputs(",
    )]
    assert order == sorted(order)
