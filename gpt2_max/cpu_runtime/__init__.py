"""The package's runtime policy around MAX's: not what MAX asks of an architecture.

A room of its own (`extensions.ROOMS`): the model gets it as one `Extension`, and a
copy that deletes this folder loses nothing but speed. What it does:

- on the CPU, after the graph compiles, MAX's worker threads go below the Python
  thread that drives each step, and after the first execute MAX's engine poller
  goes to the idle class (`threads`, `GPT2_MAX_WORKER_NICE=0` to leave both be);
- on any device, every step runs the compiled graph through `execute_raw` on the
  buffers the batch processor laid out, skipping the base class's per-call check
  and `Tensor` wrapping of every argument and result (a tenth of a millisecond a
  step: a few percent of a 4-bit decode step on the CPU, more of a GPU's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from max import tree
from max.pipelines.lib import ModelInputs, ModelOutputs

from ..extensions import Extension
from .threads import idle_engine_poller, thread_ids, yield_to_main_thread

T = TypeVar("T")


class RuntimePolicy(Extension):
    """For a `ModuleV3PipelineModelWithKVCache` whose module returns `ModuleV3Outputs`."""

    def __init__(self) -> None:
        self._threads_before_load: set[int] | None = None
        """On the CPU, until the first execute has idled MAX's engine poller: the
        process's threads before the model loaded, so the poller is told from threads
        that were there."""

    def load(self, model: Any, load: Callable[[], T]) -> T:
        on_host = all(device.is_host for device in model.devices)
        threads = thread_ids() if on_host else None
        compiled = load()
        if on_host:
            yield_to_main_thread()
        self._threads_before_load = threads
        return compiled

    def execute(
        self, model: Any, inputs: ModelInputs, run: Callable[[ModelInputs], ModelOutputs]
    ) -> ModelOutputs:
        # The step itself, run raw instead of through `run` (the base class's execute).
        out = tree.unflatten(model.model.out_tree, model.model.execute_raw(*inputs.buffers))
        if self._threads_before_load is not None:
            idle_engine_poller(self._threads_before_load)
            self._threads_before_load = None
        return ModelOutputs(
            logits=out.next_token_logits if out.logits is None else out.logits,
            next_token_logits=out.next_token_logits,
            logit_offsets=out.logit_offsets,
        )


def extend(model: Any) -> RuntimePolicy:
    return RuntimePolicy()
