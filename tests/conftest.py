"""Shared fixtures: HF reference models, their checkpoints, and loaded MAX models.

Every distinct GPT-2 graph costs MAX a 1-3 minute compile on these CPUs (cached
under ~/.cache/modular afterwards), so checkpoints that share a graph share a
config, and each loaded model is kept for the whole session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from max.pipelines import AutoModel
from transformers import GPT2Config, GPT2LMHeadModel

from tests.reference import (
    TINY,
    random_hf_model,
    save_hub_layout,
    save_transformers_layout,
)

VARIANTS: dict[str, dict] = {
    # The GPT-2 family's own settings: gelu_new, tied head, 1/sqrt(d) scaling.
    "default": dict(TINY),
    # Every other knob that changes the math, in one graph.
    "relu-untied-layer-scaled": dict(
        TINY,
        activation_function="relu",
        scale_attn_by_inverse_layer_idx=True,
        tie_word_embeddings=False,
        n_inner=96,
        layer_norm_epsilon=1e-3,
    ),
    "gelu-unscaled": dict(TINY, activation_function="gelu", scale_attn_weights=False),
}

LAYOUTS: dict[str, Callable[[GPT2LMHeadModel, Path], Path]] = {
    "hub": save_hub_layout,
    "transformers-sharded": lambda model, folder: save_transformers_layout(
        model, folder, shard=True
    ),
}


@pytest.fixture(scope="session")
def hf_models() -> Callable[[str], GPT2LMHeadModel]:
    """The reference model of a variant, built once."""
    cache: dict[str, GPT2LMHeadModel] = {}

    def get(variant: str) -> GPT2LMHeadModel:
        if variant not in cache:
            cache[variant] = random_hf_model(GPT2Config(**VARIANTS[variant]))
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, hf_models: Callable[[str], GPT2LMHeadModel]
) -> Callable[[str, str], Path]:
    """The checkpoint folder of a (variant, layout), written once."""
    cache: dict[tuple[str, str], Path] = {}

    def get(variant: str, layout: str) -> Path:
        if (variant, layout) not in cache:
            folder = tmp_path_factory.mktemp(f"{variant}-{layout}")
            cache[variant, layout] = LAYOUTS[layout](hf_models(variant), folder)
        return cache[variant, layout]

    return get


@pytest.fixture(scope="session")
def max_models() -> Iterator[Callable[[Path], AutoModel]]:
    """A MAX model loaded in-process per checkpoint, batching up to 4 prompts.

    A `.gguf` path is loaded from its folder with that file as the weights
    (MAX picks GGUF files in a folder by name patterns only some names match).
    """
    cache: dict[Path, AutoModel] = {}

    def get(path: Path) -> AutoModel:
        if path not in cache:
            weights = dict(weight_path=[str(path)]) if path.suffix == ".gguf" else {}
            cache[path] = AutoModel(
                str(path.parent if weights else path),
                max_batch_size=4,
                devices="cpu",
                custom_architectures=["gpt2_max"],
                **weights,
            )
        return cache[path]

    yield get
    for model in cache.values():
        model.close()
