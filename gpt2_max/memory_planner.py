"""Sizes the paged KV cache for `--max-batch-total-tokens` when it is given.

MAX 26.7 sizes the cache for `--max-batch-size` sequences of full length, as
far as `--device-memory-utilization` of the free memory allows. On a GPU that
fraction bounds it; on the CPU the free memory is the host's, so a large batch
size reserves gigabytes whatever the real demand (figures:
`benchmarks/results/2026-11-23-memory-bounded-kv-cache.md`).
Other servers let the user size the cache directly
(llama.cpp's `-c`, shared by its `--parallel` slots).

`--max-batch-total-tokens` already caps the context the scheduler keeps
resident across a batch, so it is the natural size for the cache: this planner
makes the cache hold that many tokens (whole pages, plus MAX's null page) and
no more. Demand beyond it waits in MAX's scheduler, which admits new requests
only within the budget and preempts (later resumes) a decoding request when
pages run out. Without the flag MAX's own sizing is unchanged.

A room that takes memory beside the model's (a speculative draft's weights and
its own pages, one for each of the model's: `extensions.memory_beside`) is left
it: without the flag the cache gets the share of the remainder that leaves the
room its fixed bytes and its bytes for each of the cache's pages.

MAX counts the weights' files' bytes for the weights, and some are held in more.
Where MAX's plain layers serve (a GPU, or `GPT2_MAX_LAYERS=plain` on the CPU), every
weight is held in the graph's dtype, and a GGUF's packed blocks are dequantized at
load (`layers.Layers.prepare`): several times the file's bytes. The CPU's fast
layers hold a safetensors checkpoint in float32, twice the bytes of one saved in
half precision, and a GGUF's token table (and any block type without a kernel)
dequantized. The planner reserves the difference too (`held_excess`).

The planner's only say over the cache is the memory it reserves besides the
weights (`estimate_activation_memory`); MAX gives the cache what remains of
the usable free memory (as much of it as `--max-batch-size` full sequences
take). So the reservation is that remainder less the budget, or less the cache's
share of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from max.driver import load_devices
from max.pipelines.kv_cache.memory_planner import PagedMemoryPlanner

from .extensions import Beside, memory_beside
from .shims.internals import free_memory, planner_config
from .weights.formats import held_bytes
from .weights.schema import parameter_count


def kv_cache_budget_bytes(kv_params: Any, total_tokens: int) -> int:
    """Bytes of a paged cache holding `total_tokens` tokens, plus the null page."""
    pages = math.ceil(total_tokens / kv_params.page_size) + 1
    return pages * kv_params.bytes_per_block


def cache_share(remainder: int, page_bytes: int, beside: Beside) -> int:
    """Bytes of whole pages the cache may take of `remainder` (the usable memory
    left after the weights and activations) so that what `beside` takes fits too."""
    if beside == Beside():
        return remainder
    pages = max(0, remainder - beside.fixed) // (page_bytes + beside.per_page)
    return pages * page_bytes


def held_excess(
    config: Any, huggingface_config: Any, weight_paths: Sequence[Any],
    file_bytes: Callable[[], int],
) -> int:
    """Bytes the weights of arch config `config` take beyond their files (`file_bytes`,
    asked only here): where the plain layers hold each in the graph's dtype (the head
    padded to `head_rows`), and where the fast layers hold what the adapter of the
    files `weight_paths` hands over (`formats.held_bytes`: a safetensors checkpoint in
    float32, a GGUF's tables and kernel-less blocks dequantized)."""
    if config.fast_layers:
        held = held_bytes(weight_paths, huggingface_config)
        if held is None:
            return 0
    else:
        values = parameter_count(huggingface_config) + (
            config.head_rows - config.vocab_size
        ) * config.hidden_size
        held = values * config.dtype.size_in_bytes
    return max(0, held - file_bytes())


class TokenBudgetMemoryPlanner(PagedMemoryPlanner):
    """`PagedMemoryPlanner` whose cache holds `--max-batch-total-tokens` tokens, when set,
    and otherwise leaves the rooms what they take beside it."""

    def estimate_activation_memory(
        self, pipeline_config: Any, huggingface_config: Any
    ) -> int:
        config = planner_config(self)
        reserved = super().estimate_activation_memory(
            pipeline_config, huggingface_config
        ) + held_excess(
            config, huggingface_config, pipeline_config.model.resolved_weight_paths(),
            lambda: self.estimate_weights_size(pipeline_config),
        )
        total_tokens = pipeline_config.runtime.max_batch_total_tokens
        kv_params = config.get_kv_params()
        beside = memory_beside(pipeline_config, huggingface_config, kv_params)
        if total_tokens is None and beside == Beside():
            return reserved
        model = pipeline_config.model
        usable = int(
            free_memory(load_devices(model.device_specs))
            * model.kv_cache.device_memory_utilization
        )
        static = (
            self.estimate_weights_size(pipeline_config)
            + self.estimate_signal_buffer_memory(pipeline_config, config)
            + reserved
        )
        if total_tokens is None:
            cache = cache_share(usable - static, kv_params.bytes_per_block, beside)
            return reserved + max(0, usable - static - cache)
        budget = kv_cache_budget_bytes(kv_params, total_tokens)
        slack = kv_params.bytes_per_block - 1
        return reserved + max(0, usable - static - budget - slack)
