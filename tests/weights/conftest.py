"""GGUF files written once per session from the reference models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import GPT2LMHeadModel

from gpt2_max.testing.reference import load_reference, save_gguf, write_tiny_checkpoint

QUANTIZED = dict(n_embd=256)
"""K-quant blocks hold 256 values, so rows (n_embd, 4 * n_embd) must be multiples of 256."""

XL_ROWS = dict(n_embd=320, n_head=5)
"""Rows of 320 values, as gpt2-xl's 1600 no multiple of 256: a k-quant mix then writes
its projections over `n_embd` in the fallback types (Q5_0, Q5_1, Q8_0), those over
`4 * n_embd` (1280) still in k-quants."""


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory) -> Callable[[GPT2LMHeadModel, str], Path]:
    """The GGUF of (reference model, file type) in its own servable folder, written once."""
    cache: dict[tuple[int, str], Path] = {}

    def get(model: GPT2LMHeadModel, file_type: str) -> Path:
        key = (id(model), file_type)
        if key not in cache:
            cache[key] = save_gguf(model, tmp_path_factory.mktemp(f"gguf-{file_type}"), file_type)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def quantized_model(tmp_path_factory) -> GPT2LMHeadModel:
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("quantized"), **QUANTIZED)
    return load_reference(folder)


@pytest.fixture(scope="session")
def xl_rows_model(tmp_path_factory) -> GPT2LMHeadModel:
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("xl-rows"), **XL_ROWS)
    return load_reference(folder)
