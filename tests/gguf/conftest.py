"""The xl-shaped reference model (its GGUF files come from the shared `gguf_files`)."""

from __future__ import annotations

import pytest
from transformers import GPT2LMHeadModel

from gpt2_max.testing.reference import load_reference, write_tiny_checkpoint

XL_ROWS = dict(n_embd=320, n_head=5)
"""Rows of 320 values, as gpt2-xl's 1600 no multiple of 256: a k-quant mix then writes
its projections over `n_embd` in the fallback types (Q5_0, Q5_1, Q8_0), those over
`4 * n_embd` (1280) still in k-quants."""


@pytest.fixture(scope="session")
def xl_rows_model(tmp_path_factory) -> GPT2LMHeadModel:
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("xl-rows"), **XL_ROWS)
    return load_reference(folder)
