"""The sampler of greedy and unrestricted rows, and the router in front of MAX's.

A row is *plain* when it asks for nothing that needs the vocabulary sorted: greedy
(top-k 1, which MAX makes of temperature 0, whatever top-p or min-p it also names, as
the largest logit passes both), or a temperature with no top-k, top-p or min-p. Such
a row's token is the largest logit, or the first token whose running sum of
softmax(logits / temperature) exceeds a uniform draw times the sum: MAX's softmax,
cumulative sum, comparison and sum, a few passes over the row. The draw is a
function of the row's seed (MAX's Philox key for the row's next token,
`shims.internals.row_seed`), so a seeded request repeats exactly. A call of greedy
rows alone takes the largest logits in a graph of their own, which skips MAX's
sampler graph and the `min_p` cut `shims.min_p` adds to it. Every other row goes to
MAX's graph, which draws each row from its own seed too; a batch of both kinds is
split by row, so neither kind's tokens depend on the other's presence.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType, ops
from max.pipelines.sampling import batch_max_k

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

GREEDY_INPUTS = ("logits", "prev_tokens", "seed")
"""The inputs of the graph of greedy rows alone."""


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


def greedy_rows_graph(device: DeviceRef) -> Graph:
    """Tokens, every token so far and the next seeds, as MAX's sampler graph returns
    them, for a batch of greedy rows: each row's largest logit."""
    types = [
        TensorType(DType.float32, ["batch", "vocab_size"], device),
        TensorType(DType.int64, ["batch", "num_prev_steps"], device),
        TensorType(DType.uint64, ["batch"], device),
    ]
    with Graph("gpt2_max_greedy_rows_sampler", input_types=types) as graph:
        logits, prev_tokens, seed = (v.tensor for v in graph.inputs)
        tokens = ops.squeeze(ops.argmax(logits, axis=-1), -1)
        graph.output(tokens, ops.concat([prev_tokens, ops.unsqueeze(tokens, -1)], -1), seed + 1)
    return graph


def is_min_tokens_mask(buffer: Buffer) -> bool:
    """Whether `buffer` is MAX's min-tokens mask: int32 (row, token) pairs (the graph's
    other optional inputs, returned logits and penalties, are neither)."""
    return buffer.dtype == DType.int32 and len(buffer.shape) == 2 and buffer.shape[1] == 2


class PlainRowsSampler:
    """Called as MAX calls its sampler graph (`_sample_logits`): plain rows go to this
    package's graph and the others to `fallback`, MAX's own graph, so each row's token
    is a function of its own logits and seed, whatever rows share its batch (each half
    draws a row as it would alone). A call of greedy rows alone goes to this package's
    graph of them; one whose plain rows are all greedy beside rows that need a sort,
    or with inputs past MAX's plain ones, goes to `fallback` whole."""

    def __init__(self, fallback: Any, device: Device) -> None:
        self._fallback = fallback
        self._device = device
        session = InferenceSession(devices=[device])
        self._graph = session.load(plain_rows_graph(DeviceRef.from_device(device)))
        self._greedy = session.load(greedy_rows_graph(DeviceRef.from_device(device)))

    def plain_rows(self, inputs: tuple[Buffer, ...]) -> np.ndarray | None:
        """Per row, whether this package's graph draws it; none where MAX's graph takes
        the whole call: one with other inputs than MAX's plain ones and perhaps a
        min-tokens mask (penalties, returned logits, a grammar's bitmask), or whose
        plain rows are all greedy beside rows that are not (MAX's kernel takes their
        largest logits as fast as a split would)."""
        if len(inputs) == len(PLAIN_INPUTS) + 1 and is_min_tokens_mask(inputs[-1]):
            inputs = inputs[:-1]
        if len(inputs) != len(PLAIN_INPUTS) or inputs[0].dtype != DType.float32:
            return None
        named = dict(zip(PLAIN_INPUTS, inputs, strict=True))
        top_k = named["top_k"].to_numpy()
        unrestricted = (top_k <= 0) | (top_k >= named["logits"].shape[1])
        rows = (top_k == 1) | (unrestricted & (named["top_p"].to_numpy() >= 1.0)
                               & (named["min_p"].to_numpy() == 0.0))
        return rows if rows.all() or (rows & (top_k != 1)).any() else None

    def __call__(self, *inputs: Buffer) -> list[Buffer]:
        rows = self.plain_rows(inputs)
        if rows is None:
            return self._fallback(*inputs)
        if rows.all():
            return self._draw(*inputs)
        return self._split(inputs, rows)

    def _draw(self, *inputs: Buffer) -> list[Buffer]:
        """This package's graph over plain rows (its greedy graph where all are greedy)."""
        named = dict(zip(PLAIN_INPUTS, inputs, strict=False))
        if len(inputs) > len(PLAIN_INPUTS):
            # As MAX's graph does, in the logits buffer itself (MAX reads it after).
            rows, tokens = inputs[-1].to_numpy().T
            named["logits"].to_numpy()[rows, tokens] = MIN_TOKENS_FILL
        if (named["top_k"].to_numpy() == 1).all():
            return self._greedy.execute(*(named[name] for name in GREEDY_INPUTS))
        draws = uniform_draws(named["seed"].to_numpy())
        named["draw"] = Buffer.from_numpy(draws).to(self._device)
        return self._graph.execute(*(named[name] for name in GRAPH_INPUTS))

    def _split(self, inputs: tuple[Buffer, ...], rows: np.ndarray) -> list[Buffer]:
        """The plain `rows` through this package's graph, the others through MAX's, each
        half called as MAX calls its graph for a batch of those rows alone, and the
        outputs put back in row order."""
        arrays = [buffer.to_numpy() for buffer in inputs]
        named = dict(zip(PLAIN_INPUTS, arrays, strict=False))
        mask = arrays[-1] if len(arrays) > len(PLAIN_INPUTS) else None
        if mask is not None:  # the whole logits buffer, as MAX's graph leaves it
            named["logits"][mask[:, 0], mask[:, 1]] = MIN_TOKENS_FILL
        outputs: list[np.ndarray] | None = None
        for sample, chosen in ((self._draw, rows), (self._fallback, ~rows)):
            index = np.flatnonzero(chosen)
            part = {name: value[index] for name, value in named.items() if value.ndim}
            part["max_k"] = np.array(batch_max_k(part["top_k"]), dtype=np.int64)
            part["min_top_p"] = np.array(part["top_p"].min(), dtype=np.float32)
            call = [part[name] for name in PLAIN_INPUTS]
            if mask is not None:
                kept = mask[np.isin(mask[:, 0], index)]
                call.append(np.stack([np.searchsorted(index, kept[:, 0]), kept[:, 1]], 1)
                            .astype(mask.dtype).reshape(-1, 2))
            buffers = [Buffer.from_numpy(np.require(a, requirements="C")) for a in call]
            made = [out.to_numpy() for out in sample(*(  # max_k, min_top_p: host scalars
                b if b.rank == 0 else b.to(self._device) for b in buffers))]
            if outputs is None:
                outputs = [np.empty((len(rows), *out.shape[1:]), out.dtype) for out in made]
            for whole, out in zip(outputs, made, strict=True):
                whole[index] = out
        assert outputs is not None
        return [Buffer.from_numpy(out).to(self._device) for out in outputs]
