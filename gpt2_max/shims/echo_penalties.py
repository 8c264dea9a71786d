"""Penalties on a server that also returns every prompt position's logits
(`--enable-echo --enable-penalties`), whose model worker MAX 26.7 cannot start.

With echo, MAX's sampler graph types its logits as a ragged `[total_output_len, vocab]`
buffer (`enable_variable_logits`), and `apply_penalties_to_logits` refuses the
per-request penalties, `[batch]`, beside it while the graph is built: the worker dies
before its first request ("repetition_penalty tensor shape [Dim('batch')] does not match
logits_buffer shape [Dim('total_output_len'), ...]"), whatever the architecture. The
text pipeline only ever hands that graph each request's last row, though
(`logits_for_sampling`: `next_token_logits`, with offsets 0 to the batch size), so its
rows are the requests. This patch of the name the graph's builder calls binds each
penalty to the buffer's rows (`ops.rebind`), an equality the graph then checks at every
call: logits of more rows than requests fail with MAX's error rather than penalize rows
of other requests. Where the two already agree, MAX's call is unchanged.

Installed by `shims.install`; it acts where a sampler graph is built after it (the
model worker, an in-process `Generator`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from max.graph import TensorValue, ops
from max.pipelines.sampling import sampling

PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty")
"""The keyword arguments of `apply_penalties_to_logits` that hold one value per request."""


def on_the_rows(apply: Callable[..., None]) -> Callable[..., None]:
    """`apply` (MAX's `apply_penalties_to_logits`), each per-request penalty bound to the
    logits buffer's rows first."""
    @functools.wraps(apply)
    def penalize(logits_buffer: Any, frequency_data: Any, frequency_offsets: Any,
                 **penalties: Any) -> None:
        rows = logits_buffer.shape[0]
        for name in PENALTIES:
            value = penalties.get(name)
            if isinstance(value, float | None):
                continue
            value = TensorValue(value)
            if value.shape[0] != rows:
                penalties[name] = ops.rebind(
                    value, [rows],
                    message=f"{name}: the sampler was given logits of more rows than requests",
                )
        apply(logits_buffer, frequency_data, frequency_offsets, **penalties)

    penalize.on_the_rows = True  # type: ignore[attr-defined]
    return penalize


def install() -> None:
    """Puts `on_the_rows` in place of the sampler graph builder's penalty call (once)."""
    if not getattr(sampling.apply_penalties_to_logits, "on_the_rows", False):
        sampling.apply_penalties_to_logits = on_the_rows(sampling.apply_penalties_to_logits)
