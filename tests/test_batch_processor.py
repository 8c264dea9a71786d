"""Position ids follow each context's processed and active windows."""

from __future__ import annotations

import numpy as np
import pytest
from max.pipelines.context import TextContext
from max.pipelines.context.tokens import TokenBuffer

from gpt2_max.batch_processor import position_ids

pytestmark = pytest.mark.tier("unit")


def context(length: int, processed: int) -> TextContext:
    ctx = TextContext(max_length=2048, tokens=TokenBuffer(np.arange(length, dtype=np.int64)))
    ctx.tokens.skip_processing(processed)  # as after a prefix-cache hit
    return ctx


def test_positions_start_where_the_cache_ends():
    contexts = [context(5, 0), context(10, 4)]
    assert position_ids(contexts).tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9]


def test_a_processing_offset_is_refused():
    """MAX 26.7 never sets one; if it starts to, positions must not silently shift."""
    ctx = context(10, 4)
    ctx.apply_processing_offset(2)
    with pytest.raises(ValueError, match="processing offset 2"):
        position_ids([ctx])
