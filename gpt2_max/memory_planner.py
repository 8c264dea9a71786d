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

The planner's only say over the cache is the memory it reserves besides the
weights (`estimate_activation_memory`); MAX gives the cache what remains of
the usable free memory. So the reservation is that remainder less the budget.
"""

from __future__ import annotations

import math
from typing import Any

from max.driver import load_devices
from max.pipelines.kv_cache.memory_planner import PagedMemoryPlanner

from .shims.internals import free_memory, planner_config


def kv_cache_budget_bytes(kv_params: Any, total_tokens: int) -> int:
    """Bytes of a paged cache holding `total_tokens` tokens, plus the null page."""
    pages = math.ceil(total_tokens / kv_params.page_size) + 1
    return pages * kv_params.bytes_per_block


class TokenBudgetMemoryPlanner(PagedMemoryPlanner):
    """`PagedMemoryPlanner` whose cache holds `--max-batch-total-tokens` tokens, when set."""

    def estimate_activation_memory(
        self, pipeline_config: Any, huggingface_config: Any
    ) -> int:
        reserved = super().estimate_activation_memory(pipeline_config, huggingface_config)
        total_tokens = pipeline_config.runtime.max_batch_total_tokens
        if total_tokens is None:
            return reserved
        config = planner_config(self)
        kv_params = config.get_kv_params()
        budget = kv_cache_budget_bytes(kv_params, total_tokens)
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
        slack = kv_params.bytes_per_block - 1
        return reserved + max(0, usable - static - budget - slack)
