"""The `gpu` tier: GPT-2 on an NVIDIA GPU as users type it, against transformers.

Every test here is marked `gpu`; `tests/conftest.py` deselects the tier where MAX
sees no accelerator, so a CPU run reports it as deselected, never as skipped.
Run it on a GPU machine with `python -m pytest -m gpu`.

The checkpoints are the suite's own random ones (`write_tiny_checkpoint`) with a
head size of 64, every GPT-2's (`TINY_HEAD64`), so MAX's GPU attention kernels run
at the shape they serve, and a weight spread (`GPU_STD`) that gives most greedy
steps a top-2 margin well above bfloat16's noise; the parity tests check that it
does, so a comparison is never a coin toss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from max.pipelines import AutoModel
from transformers import GPT2LMHeadModel

from gpt2_max.testing.reference import TINY_HEAD64, load_reference, write_tiny_checkpoint

from .parity import GPU_STD, IN_PROCESS


@pytest.fixture(scope="session")
def gpu_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("gpu-checkpoint"), seed=3, std=GPU_STD, **TINY_HEAD64
    )


@pytest.fixture(scope="session")
def gpu_reference(gpu_checkpoint: Path) -> GPT2LMHeadModel:
    return load_reference(gpu_checkpoint)


@pytest.fixture(scope="session")
def gpu_models(gpu_checkpoint: Path) -> Iterator[Callable[[str | None], AutoModel]]:
    """A MAX model of `gpu_checkpoint` on the GPU per encoding (None: MAX's default)."""
    cache: dict[str | None, AutoModel] = {}

    def get(encoding: str | None) -> AutoModel:
        if encoding not in cache:
            cache[encoding] = AutoModel(
                str(gpu_checkpoint),
                devices="gpu",
                max_batch_size=4,
                custom_architectures=["gpt2_max"],
                **IN_PROCESS,
                **({} if encoding is None else {"quantization_encoding": encoding}),
            )
        return cache[encoding]

    yield get
    for model in cache.values():
        model.close()
