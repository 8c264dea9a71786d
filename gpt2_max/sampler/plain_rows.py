"""The sampler of greedy and unrestricted rows, and the router in front of MAX's.

A row is *plain* when it asks for nothing that needs the vocabulary sorted: greedy
(top-k 1, which MAX makes of temperature 0), or a temperature with no top-k, top-p
or min-p. Such a row's token is the largest logit, or the first token whose running
sum of softmax(logits / temperature) exceeds a uniform draw times the sum: MAX's
softmax, cumulative sum, comparison and sum, a few passes over the row. The draw is
a function of the row's seed (MAX's Philox key for the row's next token,
`shims.internals.row_seed`), so a seeded request repeats exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, ops

PLAIN_INPUTS = (
    "logits", "prev_tokens", "top_k", "max_k", "temperature", "top_p", "min_top_p",
    "min_p", "seed",
)
"""The inputs of MAX's sampler graph when it has no penalties and returns no logits
(`_sampling_input_types`), before the min-tokens mask when it has one (`MIN_TOKENS`);
a call with any other inputs goes to MAX's graph."""

MIN_TOKENS_FILL = -10000.0
"""What MAX's sampler graph writes into the logits at each (row, token) of a
min-tokens mask (`scatter_set_constant`), as this sampler does too."""

GRAPH_INPUTS = ("logits", "prev_tokens", "top_k", "temperature", "draw", "seed")
"""The inputs of this package's graph: MAX's, less what plain rows leave unused, plus
each row's uniform draw."""


def uniform_draws(seeds: np.ndarray) -> np.ndarray:
    """One number in [0, 1) per seed, a fixed function of it (SplitMix64's finalizer,
    whose outputs pass statistical tests for consecutive inputs, as a row's keys
    are), as float32 below 1."""
    z = seeds.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    draws = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.minimum(draws.astype(np.float32), np.nextafter(np.float32(1), np.float32(0)))


def plain_rows_graph(device: DeviceRef) -> Graph:
    """Tokens, every token so far and the next seeds, as MAX's sampler graph returns
    them, for a batch of plain rows."""
    types = [
        TensorType(DType.float32, ["batch", "vocab_size"], device),
        TensorType(DType.int64, ["batch", "num_prev_steps"], device),
        TensorType(DType.int64, ["batch"], device),
        TensorType(DType.float32, ["batch"], device),
        TensorType(DType.float32, ["batch"], device),
        TensorType(DType.uint64, ["batch"], device),
    ]
    with Graph("gpt2_max_plain_rows_sampler", input_types=types) as graph:
        logits, prev_tokens, top_k, temperature, draw, seed = (v.tensor for v in graph.inputs)
        # A greedy row's temperature may be 0: divide it by 1 (its token is the argmax).
        scale = ops.where(temperature > 0, temperature, ops.constant(1.0, DType.float32, device))
        running = ops.cumsum(ops.softmax(logits / ops.unsqueeze(scale, -1)), axis=-1)
        total = running[:, -1:]
        # The first token whose running sum exceeds the draw's share of the total: as
        # many tokens as stay at or below it. A zero-probability token adds nothing to
        # the sum, so it is never the one; a draw rounding up to the total is the last.
        below = running <= ops.unsqueeze(draw, -1) * total
        drawn = ops.squeeze(ops.sum(ops.cast(below, DType.int64), axis=-1), -1)
        last = ops.cast(ops.shape_to_tensor([logits.shape[1]]), DType.int64) - 1
        drawn = ops.min(drawn, last)
        greedy = ops.squeeze(ops.argmax(logits, axis=-1), -1)
        tokens = ops.where(top_k == 1, greedy, drawn)
        all_tokens = ops.concat([prev_tokens, ops.unsqueeze(tokens, -1)], -1)
        graph.output(tokens, all_tokens, seed + 1)
    return graph


def is_min_tokens_mask(buffer: Buffer) -> bool:
    """Whether `buffer` is MAX's min-tokens mask: int32 (row, token) pairs (the graph's
    other optional inputs, returned logits and penalties, are neither)."""
    return buffer.dtype == DType.int32 and len(buffer.shape) == 2 and buffer.shape[1] == 2


class PlainRowsSampler:
    """Called as MAX calls its sampler graph (`_sample_logits`): batches of plain rows,
    some of them sampled, go to this package's graph, any other call to `fallback`,
    MAX's own graph."""

    def __init__(self, fallback: Any, device: Device) -> None:
        self._fallback = fallback
        self._device = device
        session = InferenceSession(devices=[device])
        self._graph = session.load(plain_rows_graph(DeviceRef.from_device(device)))

    def plain(self, inputs: tuple[Buffer, ...]) -> bool:
        """Whether the call goes to this package's graph: it has MAX's plain inputs (and
        perhaps a min-tokens mask), every row is plain, and not every row is greedy
        (MAX's kernel takes the largest logit as fast as this graph, and a whole greedy
        batch faster: it draws nothing)."""
        if len(inputs) == len(PLAIN_INPUTS) + 1 and is_min_tokens_mask(inputs[-1]):
            inputs = inputs[:-1]
        if len(inputs) != len(PLAIN_INPUTS) or inputs[0].dtype != DType.float32:
            return False
        named = dict(zip(PLAIN_INPUTS, inputs, strict=True))
        top_k = named["top_k"].to_numpy()
        vocab_size = named["logits"].shape[1]
        unrestricted = (top_k <= 0) | (top_k >= vocab_size)
        return bool(
            ((top_k == 1) | unrestricted).all() and unrestricted.any()
            and float(named["min_top_p"].to_numpy()) >= 1.0
            and not named["min_p"].to_numpy().any()
        )

    def __call__(self, *inputs: Buffer) -> list[Buffer]:
        if not self.plain(inputs):
            return self._fallback(*inputs)
        named = dict(zip(PLAIN_INPUTS, inputs, strict=False))
        if len(inputs) > len(PLAIN_INPUTS):
            # As MAX's graph does, in the logits buffer itself (MAX reads it after).
            rows, tokens = inputs[-1].to_numpy().T
            named["logits"].to_numpy()[rows, tokens] = MIN_TOKENS_FILL
        draws = uniform_draws(named["seed"].to_numpy())
        named["draw"] = Buffer.from_numpy(draws).to(self._device)
        return self._graph.execute(*(named[name] for name in GRAPH_INPUTS))
