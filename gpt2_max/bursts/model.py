"""The pipeline-model side of a decode burst: run, sample, run again."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.nn.kv_cache import packed_page_stride
from max.nn.kv_cache.utils import build_max_lengths_tensors
from max.nn.transformer import ReturnLogits
from max.pipelines.context import TextContext
from max.pipelines.lib import ModelInputs, ModelOutputs

from ..extensions import Extension
from ..inputs import GPT2Inputs
from ..names import PACKAGE
from ..settings import CPU_DECODE_STEPS, setting, settings
from ..shims import internals
from .context import BurstContext, extra_steps

logger = logging.getLogger("max.pipelines")

T = TypeVar("T")

ENV = setting("decode_steps").variable

BUDGET_ENV = setting("burst_ms").variable
"""A burst starts no step that would end (if it took as long as the one before)
past this many milliseconds from the burst's start. What a burst saves is MAX's
loop, a fixed cost a pass, so it matters where steps are short. A request arriving
mid-burst ends the burst at the next step (`DecodeBursts.receive`), so the
budget is not what such a request waits; it bounds how long a stream's client
waits between chunks. With it, a small model's step bursts to `K` and a large
one's (where the loop is a small share) a few steps or none."""


def burst_budget_s() -> float:
    """The burst budget of this process, in seconds."""
    return settings().burst_ms / 1e3


def decode_steps(on_host: bool) -> int:
    """The burst length `K` of this process: the setting, else `CPU_DECODE_STEPS` on the
    CPU and 1 (no bursts) on an accelerator, where bursts have not been measured."""
    if (steps := settings().decode_steps) is not None:
        return steps
    return CPU_DECODE_STEPS if on_host else 1


class BurstSampling:
    """MAX's sampler over one burst's rows: the sampling inputs built once, as
    MAX's `FusedSamplingProcessor` builds them, and each step's seeds advanced as
    MAX's would be after each token."""

    def __init__(self, sampler: Any, contexts: Sequence[TextContext], steps: int,
                 device: Device, min_tokens: bool) -> None:
        self._sampler = sampler
        self._device = device
        self._inputs = internals.sampler_inputs(contexts, device)
        self._seeds = np.array([internals.row_seed(c) for c in contexts], dtype=np.uint64)
        self._masks = internals.min_tokens_masks(contexts, steps, device, min_tokens)
        self._generated = Buffer(shape=(len(contexts), 0), dtype=DType.int64, device=device)

    def sample(self, logits: Buffer, step: int) -> np.ndarray:
        """The tokens MAX's sampler picks from the burst's `step`-th logits."""
        inputs = self._inputs
        if step:
            seeds = Buffer.from_numpy(self._seeds + np.uint64(step)).to(self._device)
            inputs = dataclasses.replace(inputs, seed=seeds)
        if logits.device != self._device:
            logits = logits.to(self._device)
        tokens, self._generated, _ = internals.sample_logits(
            self._sampler, logits, self._generated, inputs,
            self._masks[step] if self._masks else None,
        )
        return tokens.to_numpy().reshape(-1).astype(np.int64)


def step_inputs(
    first: GPT2Inputs, kv_params: Any, rows: Sequence[np.ndarray], starts: np.ndarray, *,
    logits_per_row: int = 1, kv_blocks: Buffer | None = None,
) -> GPT2Inputs:
    """The inputs of a further step over `first`'s rows and KV pages (the same page
    table): row `r`'s tokens `rows[r]`, at positions from `starts[r]`, where its cache
    ends; logits for the last `logits_per_row` of each row. `kv_blocks` puts another
    model's cache (a draft's, `gpt2_max.speculate`) behind the same page table. The
    inputs carry no contexts: a step made here is never a burst's first."""
    device = first.tokens.device
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    ends = starts + lengths
    positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
    (kv,) = first.kv_cache_inputs
    widest, longest = int(lengths.max()), int(ends.max())
    max_prompt, max_cache = build_max_lengths_tensors(widest, longest)
    dispatch = kv.attention_dispatch_metadata
    if dispatch is not None:
        key = kv_params.resolve_attn_key(len(rows), widest, longest)
        (dispatch,) = key.dispatch_metadata_buffers(
            None, name="", devices=[device], max_cache_valid_length=longest
        )
    kv = dataclasses.replace(
        kv,
        cache_lengths=Buffer.from_numpy(starts.astype(np.uint32)).to(device),
        max_prompt_length=max_prompt,
        max_cache_length=max_cache,
        attention_dispatch_metadata=dispatch,
    )
    if kv_blocks is not None:
        kv = dataclasses.replace(kv, kv_blocks=kv_blocks, page_stride=packed_page_stride(kv_blocks))
    return dataclasses.replace(
        first,
        tokens=Buffer.from_numpy(np.concatenate(rows).astype(np.int64)).to(device),
        position_ids=Buffer.from_numpy(positions.astype(np.int64)).to(device),
        return_n_logits=Buffer.from_numpy(np.array([logits_per_row], dtype=np.int64)),
        input_row_offsets=Buffer.from_numpy(offsets).to(device),
        kv_cache_inputs=(kv,),
        contexts=(),
    )


class DecodeBursts(Extension):
    """The model's extension for bursts: pure-decode batches run up to `K` steps an
    `execute` (see the package doc). Its `execute` returns what the one-step loop
    returns; the further tokens reach MAX through `BurstContext`."""

    takes = frozenset({"sampler", "waiting_requests"})

    def __init__(self) -> None:
        self._steps = 1
        self._budget_s = 0.0
        self._sampler: Any = None
        self._sampler_device: Device | None = None
        self._request_waiting: Callable[[], bool] | None = None

    def load(self, model: Any, load: Callable[[], T]) -> T:
        compiled = load()
        sampling = model.pipeline_config.sampling
        # What MAX's loop does per token that a burst does not: all logits (echo),
        # penalties over the tokens so far, variable logits.
        if (model.return_logits is ReturnLogits.LAST_TOKEN
                and not sampling.enable_penalties and not sampling.enable_variable_logits):
            self._steps = decode_steps(model.devices[0].is_host)
            self._budget_s = burst_budget_s()
        return compiled

    def receive(self, model: Any, part: str, *value: Any) -> None:
        """The text pipeline's own sampler graph and its device ("sampler", handed over
        once the pipeline is built, `shims.shared_sampler`: until then, and without it,
        no bursts); and whether a request waits at MAX's scheduler ("waiting_requests",
        `shims.waiting_requests`): a burst ends as soon as one does, so it is admitted
        at the next pass instead of after the whole burst."""
        if part == "sampler":
            self._sampler, self._sampler_device = value
            if self._steps > 1:
                logger.info(
                    f"{PACKAGE}: decode batches run up to {self._steps} steps a pass "
                    f"(set {ENV}=1 for one)"
                )
        elif part == "waiting_requests":
            (self._request_waiting,) = value
            if self._steps > 1:
                logger.info(f"{PACKAGE}: a decode burst ends at the step a new request arrives")

    def execute(
        self, model: Any, inputs: ModelInputs, run: Callable[[ModelInputs], ModelOutputs]
    ) -> ModelOutputs:
        started = time.perf_counter()
        outputs = run(inputs)
        if self._steps > 1 and self._sampler is not None and isinstance(inputs, GPT2Inputs):
            self._burst(model, inputs, outputs, started, run)
        return outputs

    def _burst(
        self, model: Any, first: GPT2Inputs, outputs: ModelOutputs, started: float,
        run: Callable[[ModelInputs], ModelOutputs],
    ) -> None:
        contexts = first.contexts
        deadline = started + self._budget_s
        if not contexts or 2 * time.perf_counter() - started > deadline:
            return  # a second step, as long as the first, would end past the budget
        page_size = model.kv_params.page_size
        extra = min(self._steps - 1, *(extra_steps(c, page_size) for c in contexts))
        if extra <= 0:
            return
        sampling = BurstSampling(
            self._sampler, contexts, extra + 1, self._sampler_device,
            model.pipeline_config.sampling.enable_min_tokens,
        )
        positions = np.array([c.tokens.processed_length for c in contexts], dtype=np.int64)
        ends = [c.eos_tracker.eos_token_ids for c in contexts]  # as MAX's loop reads them
        tokens = sampling.sample(outputs.next_token_logits, 0)
        made = [tokens]
        mark = started
        for step in range(1, extra + 1):
            if all(int(t) in end for t, end in zip(tokens, ends, strict=True)):
                break  # every row has ended; nothing more to make
            now = time.perf_counter()
            if 2 * now - mark > deadline:
                break  # the next step, as long as the last, would end past the budget
            mark = now
            if self._request_waiting is not None and self._request_waiting():
                break  # let MAX admit it now
            step_outputs = run(
                step_inputs(first, model.kv_params, tokens[:, None], positions + step)
            )
            tokens = sampling.sample(step_outputs.next_token_logits, step)
            made.append(tokens)
        for context, row in zip(contexts, np.stack(made, axis=1).tolist(), strict=True):
            assert isinstance(context, BurstContext)
            context.expect_burst(row)
