"""Per-step graph inputs of the GPT-2 pipeline model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from max import tree
from max.driver import Buffer
from max.pipelines.context import TextContext
from max.pipelines.lib import ModelInputs


@dataclass
class GPT2Inputs(ModelInputs):
    """One step's ragged batch, in the order `GPT2.forward` takes it."""

    tokens: Buffer
    """`[total_tokens]` int64: every sequence's active tokens, concatenated."""

    position_ids: Buffer
    """`[total_tokens]` int64: each token's position in its own sequence."""

    return_n_logits: Buffer
    """`[1]` int64 on the host: how many of each sequence's last tokens get logits in
`next_token_logits` (`gpt2.last_rows`): 1 at MAX's steps, a draft's tokens and the one
before them where a draft is checked."""

    input_row_offsets: Buffer
    """`[batch + 1]` uint32: where each sequence's tokens start and end."""

    contexts: Sequence[TextContext] = field(default=(), repr=False)
    """The rows, in order: what a decode burst (`gpt2_max.bursts`) reads and
hands its tokens to. Not a graph input."""

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        kv = tree.leaves(self.kv_cache_inputs) if self.kv_cache_inputs else ()
        return (
            self.tokens,
            self.position_ids,
            self.return_n_logits,
            self.input_row_offsets,
            *kv,
        )
