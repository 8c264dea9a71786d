"""The package's speed policy around MAX's runtime: not what MAX asks of an architecture.

`CPURuntimePolicy` is mixed into the pipeline model in one place
(`model.GPT2PipelineModel`'s bases); a copier starting from the core leaves it out
and loses nothing but speed. What it does:

- on the CPU, after the graph compiles, MAX's worker threads go below the Python
  thread that drives each step, and after the first execute MAX's engine poller
  goes to the idle class (`threads`, `GPT2_MAX_WORKER_NICE=0` to leave both be);
- every step runs the compiled graph through `execute_raw` on the buffers the
  batch processor laid out, skipping the base class's per-call check and `Tensor`
  wrapping of every argument and result (a tenth of a millisecond a step, a few
  percent of a 4-bit decode step on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from max import tree
from max.pipelines.lib import ModelInputs, ModelOutputs

from .threads import idle_engine_poller, thread_ids, yield_to_main_thread


class CPURuntimePolicy:
    """Mixin for a `ModuleV3PipelineModelWithKVCache` whose module returns `ModuleV3Outputs`."""

    _threads_before_load: set[int] | None = None
    """On the CPU, until the first execute has idled MAX's engine poller: the process's
    threads before the model loaded, so the poller is told from threads that were there."""

    def load_model(self) -> Callable[..., Any]:
        on_host = all(device.is_host for device in self.devices)
        threads = thread_ids() if on_host else None
        compiled = super().load_model()
        if on_host:
            yield_to_main_thread()
        self._threads_before_load = threads
        return compiled

    def execute(self, model_inputs: ModelInputs) -> ModelOutputs:
        out = tree.unflatten(
            self.model.out_tree, self.model.execute_raw(*model_inputs.buffers)
        )
        if self._threads_before_load is not None:
            idle_engine_poller(self._threads_before_load)
            self._threads_before_load = None
        return ModelOutputs(
            logits=out.next_token_logits if out.logits is None else out.logits,
            next_token_logits=out.next_token_logits,
            logit_offsets=out.logit_offsets,
        )
