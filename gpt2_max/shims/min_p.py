"""`min_p` on the CPU, which MAX 26.7's CPU sampling kernel takes and ignores.

MAX's sampler graph (`token_sampler`) hands each row's `min_p` to its fused sampling
kernel (`max.nn.kernels.topk_fused_sampling`), whose CPU implementation draws as if
it were 0: a request's `min_p` was sampled as if unset, with no word to the client
(a seed draws the same tokens at `min_p` 0, 0.5 and 1). This patch of the name the
graph's builder calls keeps, before that kernel, only the tokens whose probability
at the row's temperature is at least `min_p` times the most likely token's, and
gives the others -inf: vLLM's rule, applied after the penalties, the min-tokens mask
and a grammar's bitmask, which the graph applies first. A kernel that applied
`min_p` to the same tempered probabilities would find nothing more to cut (the most
likely token, and every kept token's ratio to it, are unchanged). Off the CPU the
graph is MAX's own.

Installed by `shims.install`; it acts where a sampler graph is built after it (the
model worker, an in-process `Generator`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from max.dtype import DType
from max.graph import TensorValue, ops
from max.pipelines.sampling import sampling


def min_p_kept(logits: TensorValue, temperature: TensorValue, min_p: TensorValue) -> TensorValue:
    """`logits` (`[batch, vocab]`) with -inf for each token whose probability at its
    row's temperature is below `min_p` times the row's largest: p / p_max =
    exp((logit - max) / T) >= min_p where logit >= max + T * log(min_p). A `min_p` of
    0 keeps every token; a temperature of 0 (a greedy row, whose token is the largest
    logit either way) reads as 1."""
    device = logits.device
    scale = ops.where(temperature > 0, temperature, ops.constant(1.0, DType.float32, device))
    floor = ops.max(logits, axis=-1) + ops.unsqueeze(scale * ops.log(min_p), -1)
    return ops.where(logits >= floor, logits, ops.constant(float("-inf"), logits.dtype, device))


def keeps_min_p(fused: Callable[..., TensorValue]) -> Callable[..., TensorValue]:
    """`fused` (MAX's `topk_fused_sampling`), its logits cut by `min_p_kept` on the CPU."""
    @functools.wraps(fused)
    def sample(logits: TensorValue, top_k: Any, *, temperature: Any = 1.0,
               min_p: Any = None, **kwargs: Any) -> TensorValue:
        if min_p is not None and logits.device.is_cpu() and not isinstance(temperature, float):
            logits = min_p_kept(logits, TensorValue(temperature), TensorValue(min_p))
        return fused(logits, top_k, temperature=temperature, min_p=min_p, **kwargs)

    sample.keeps_min_p = True  # type: ignore[attr-defined]
    return sample


def install() -> None:
    """Puts `keeps_min_p` in place of the sampler graph builder's kernel call (once)."""
    if not getattr(sampling.topk_fused_sampling, "keeps_min_p", False):
        sampling.topk_fused_sampling = keeps_min_p(sampling.topk_fused_sampling)
