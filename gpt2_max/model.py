"""The GPT-2 pipeline model: what MAX calls to build, compile and run GPT-2.

`ModuleV3PipelineModelWithKVCache` owns the flow: it reads the weights through
the adapter of their format (`weights/`), asks `_create_model_config` for the
config (which records how the weights are held: `weights.plan`), lets the
layers prepare the weights they read (`layers.layers_for`), builds the module
under `F.lazy()` (so no placeholder weights are ever allocated), compiles it
once with symbolic batch and sequence dimensions, and runs it every step on
the `GPT2Inputs` that `GPT2BatchProcessor` prepares.
The optional rooms that change how it loads and steps (decode bursts, the runtime
policy) plug in through one seam, `extensions`: the model calls their hooks around
its own load and each execute, and imports none of them.
Log-probabilities are MAX's, computed by a `LogProbabilities` the model owns,
whose graph the first request that asks for them compiles (`log_probabilities`)
rather than every start.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Callable
from typing import Any, ClassVar

from max.driver import Buffer
from max.engine import InferenceSession
from max.nn.transformer import ReturnLogits
from max.pipelines.context import LogProbabilities as TokenLogProbabilities
from max.pipelines.context import TextContext
from max.pipelines.lib import ModelInputs, ModelOutputs, ModuleV3PipelineModelWithKVCache

from . import extensions, shims
from .batch_processor import GPT2BatchProcessor
from .gpt2 import GPT2
from .layers import layers_for
from .log_probabilities import LogProbabilities
from .max_cache import max_cache_dir
from .model_config import GPT2ArchConfig
from .names import PACKAGE
from .tokenizer import GPT2TextTokenizer
from .weights.files import holds_half_precision
from .weights.formats import check_complete, release
from .weights.plan import WeightPlan
from .weights.schema import HEAD_WEIGHT, check_finite

logger = logging.getLogger("max.pipelines")
"""MAX's pipeline logger: what `max serve` prints."""

# The one place the shims are installed: both of `max serve`'s processes import this
# module (the API process through `arch`; the model worker unpickles the pipeline
# model's class and never imports `arch`), before MAX builds what they patch.
shims.install(GPT2TextTokenizer, check_complete, holds_half_precision)

FIRST_COMPILE_CORE_MINUTES = 4
"""A first start's graph and sampler compiles on the CPU, in minutes times CPU cores
(the start profile, `benchmarks/bench_start.py`, measures them)."""

FIRST_GPU_COMPILE_MINUTES = 3
"""The same on a GPU, whose kernels take minutes to compile however many cores the
host has (`benchmarks/results/2026-11-26-gpu-h200-first-bfloat16-run.md`)."""


def announce_compile(encoding: object, on_host: bool = True) -> None:
    """One line before the graph compile, so a first start that takes minutes is not
    taken for a hung one."""
    minutes = (
        max(1, math.ceil(FIRST_COMPILE_CORE_MINUTES / (os.cpu_count() or 1)))
        if on_host else FIRST_GPU_COMPILE_MINUTES
    )
    logger.info(
        f"{PACKAGE}: compiling the GPT-2 graph for %s; the first start takes about %d "
        "minute%s on this machine, later starts reuse MAX's cache at %s",
        encoding, minutes, "" if minutes == 1 else "s", max_cache_dir(),
    )


class GPT2PipelineModel(ModuleV3PipelineModelWithKVCache[TextContext]):
    """GPT2LMHeadModel on MAX, with a paged KV cache and ragged batching.

    `_create_model_config`, `_prepare_state_dict` and `_instantiate_module` are what
    MAX asks of a ModuleV3 architecture. `extensions` holds the optional rooms'
    hooks (`gpt2_max.extensions`), which `load_model` and `execute` call around
    MAX's own; `log_probabilities` answers the requests that ask for them.
    """

    model_config_cls: ClassVar[type[Any]] = GPT2ArchConfig
    batch_processor_cls: ClassVar[type[GPT2BatchProcessor]] = GPT2BatchProcessor

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before MAX's `__init__`, which loads the model.
        self.extensions = extensions.extensions_for(self)
        self._step: Callable[[ModelInputs], ModelOutputs] = super().execute
        super().__init__(*args, **kwargs)
        self.log_probabilities = LogProbabilities(self.devices[0])

    def load_model(self) -> Callable[..., Any]:
        """Says a first compile takes minutes, compiles (inside the extensions' load
        hooks), then lets the checkpoint's file go (`weights.formats`)."""
        encoding = self.pipeline_config.model.quantization_encoding
        on_host = self.devices[0].is_host
        announce_compile(encoding, on_host)
        load = super().load_model
        for extension in reversed(self.extensions):
            load = functools.partial(extension.load, self, load)
        compiled = load()
        release(self.weights)
        step = super().execute
        for extension in reversed(self.extensions):
            step = functools.partial(extension.execute, self, run=step)
        self._step = step
        return compiled

    def execute(self, model_inputs: ModelInputs) -> ModelOutputs:
        """One step: MAX's, inside the extensions' execute hooks, outermost first."""
        return self._step(model_inputs)

    def compute_log_probabilities(
        self,
        session: InferenceSession,
        model_inputs: ModelInputs,
        model_outputs: ModelOutputs,
        next_tokens: Buffer,
        batch_top_n: list[int],
        batch_echo: list[bool],
    ) -> list[TokenLogProbabilities | None]:
        """What MAX's text pipeline calls for a batch with rows that ask for them."""
        return self.log_probabilities.compute(
            session, model_inputs, model_outputs, next_tokens, batch_top_n, batch_echo,
            self.return_logits,
        )

    def takes(self, part: str) -> bool:
        """Whether an extension wants `part` of MAX handed over (`Extension.takes`)."""
        return any(part in extension.takes for extension in self.extensions)

    def sampler_for(self, sampler: Any, device: Any) -> Any:
        """The token sampler the text pipeline should call in place of its own graph
        `sampler` (a shim's hand-over): `sampler`, as each extension makes it."""
        for extension in self.extensions:
            sampler = extension.sampler(self, sampler, device)
        return sampler

    def hand_over(self, part: str, *value: Any) -> None:
        """Gives `part` of MAX (built after the model; a shim's hand-over) to the
        extensions that take it."""
        for extension in self.extensions:
            if part in extension.takes:
                extension.receive(self, part, *value)

    def _create_model_config(self, state_dict: dict[str, Any]) -> GPT2ArchConfig:
        # The base class already built (and validated) the config from the
        # pipeline config; the logits mode is the pipeline's, given to the copy
        # the graph is built from.
        if self.return_logits not in (ReturnLogits.LAST_TOKEN, ReturnLogits.ALL):
            # MAX asks for VARIABLE only under speculative decoding, which needs
            # the overlap scheduler this architecture does not declare.
            raise ValueError(
                f"{PACKAGE} returns last-token or all logits, not {self.return_logits}."
            )
        # The fast layers hold each weight as the adapter loaded it; the plain ones
        # cast every weight to the graph's dtype (`Layers.prepare`).
        config = self.arch_config_as(GPT2ArchConfig)
        plan = WeightPlan.of(state_dict) if config.fast_layers else WeightPlan()
        if self.return_logits == ReturnLogits.LAST_TOKEN:
            # The head then multiplies each sequence's last rows alone, prefill or not.
            plan = dataclasses.replace(plan, few_rows=frozenset({HEAD_WEIGHT}))
        return dataclasses.replace(config, return_logits=self.return_logits, weights=plan)

    def _prepare_state_dict(
        self, state_dict: dict[str, Any], model_config: GPT2ArchConfig
    ) -> dict[str, Any]:
        check_finite(state_dict)
        return layers_for(model_config).prepare(state_dict)

    def _get_compile_input_types(self, model_config: GPT2ArchConfig) -> tuple[Any, ...]:
        # MAX's, but for the cache `model_config` describes rather than the model's own:
        # a draft of another shape compiles through this hook too (`speculate.draft`).
        assert self.batch_processor is not None
        return (
            *self.batch_processor.get_symbolic_inputs(
                kv_params=model_config.kv_params, device_refs=self.device_refs
            ),
            *self._modulev3_extra_input_types,
        )

    def _instantiate_module(self, model_config: GPT2ArchConfig) -> GPT2:
        module = GPT2(model_config, layers_for(model_config))
        module.to(self.devices[0])
        return module
