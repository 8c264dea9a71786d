"""Sampling at a temperature on the CPU without MAX's sort-based kernel.

MAX 26.7's sampler graph (`token_sampler`) samples every row through one fused
top-k / top-p kernel. On the CPU that kernel takes milliseconds a row whenever a
row is sampled, however few tokens it keeps, where picking the largest logit
(greedy) takes microseconds: a row sampled at a temperature costs a third of a
small model's decode step, and at 32 rows the sampler takes nearly as long as the
model (the record
`benchmarks/results/2026-11-28-serving-under-load-sampler.md`). Most requests ask
for no top-k, top-p or min-p (OpenAI's API has no top-k; clients send a
temperature), and those need no sort: a token drawn from the softmax's running
sum at one uniform draw is a token drawn from the softmax.

A room of its own (`extensions.ROOMS`): the model gets one `Extension` whose
`sampler` hook, when the sampler runs on the CPU, puts a `PlainRowsSampler` in place
of the text pipeline's sampler (`shims.shared_sampler` installs it): rows that are
greedy or unrestricted go through this package's graph of MAX's ops, and the others
through MAX's graph, split by row where a batch holds both, so a seeded row draws
the same tokens whatever requests share its batch. A batch of greedy rows alone
takes their largest logits in a graph of its own, which skips the `min_p` cut
`shims.min_p` adds to MAX's graph; one whose plain rows are all greedy beside rows
that need a sort goes to MAX's graph whole. Decode bursts sample with the same
object, so a burst's tokens are the loop's. A min-tokens mask is written into the
logits as MAX's graph writes it.
`GPT2_MAX_SAMPLER=max` leaves MAX's sampler in place; a copy that deletes this
folder samples with MAX's kernel alone.
"""

from __future__ import annotations

import logging
from typing import Any

from max.driver import Device

from ..extensions import Extension
from ..names import PACKAGE
from ..settings import setting, settings
from .plain_rows import PlainRowsSampler

__all__ = ["PlainRowsSampler", "PlainRowsSampling"]

logger = logging.getLogger("max.pipelines")


class PlainRowsSampling(Extension):
    """Replaces the text pipeline's sampler on the CPU (`PlainRowsSampler`)."""

    def sampler(self, model: Any, sampler: Any, device: Device) -> Any:
        if not device.is_host or settings().sampler == "max":
            return sampler  # MAX's kernel on an accelerator has not been measured slow
        try:
            replaced = PlainRowsSampler(sampler, device)
        except Exception as error:  # a MAX that builds or compiles the graph otherwise
            logger.warning(
                f"{PACKAGE}: sampling with MAX's sampler alone ({type(error).__name__}: "
                f"{error})"
            )
            return sampler
        logger.info(
            f"{PACKAGE}: greedy rows, and rows without top-k, top-p or min-p, are sampled by "
            f"{PACKAGE}'s sampler graph, others by MAX's (set "
            f"{setting('sampler').variable}=max for MAX's alone)"
        )
        return replaced


def extend(model: Any) -> PlainRowsSampling:
    return PlainRowsSampling()
