"""Shared fixtures: reference checkpoints per config variant, and loaded MAX models.

The "default" variant is the `gpt2_max` pytest plugin's own checkpoint (the one
its session server serves), so the package's tests run on what the plugin hands
to other test suites. Every distinct GPT-2 graph costs MAX a compile, so
checkpoints that share a graph share a config, and each loaded model is kept for
the whole session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from max.driver import accelerator_count
from max.pipelines import AutoModel
from transformers import GPT2Config, GPT2LMHeadModel

from gpt2_max.generate import Generator
from gpt2_max.model_config import GPT2_VOCAB_SIZE
from gpt2_max.settings import settings as package_settings
from gpt2_max.testing.reference import (
    TINY,
    Reference,
    load_reference,
    random_state_dict,
    save_gguf,
    save_transformers_layout,
    write_tiny_checkpoint,
)
from gpt2_max.tools.checkpoint import save_hub_checkpoint

PADDED_VOCAB_SIZE = GPT2_VOCAB_SIZE + 47
"""An embedding table padded past the tokenizer, as fine-tunes often do."""

VARIANTS: dict[str, dict] = {
    # The GPT-2 family's own settings: gelu_new, tied head, 1/sqrt(d) scaling.
    "default": dict(TINY),
    # Every other knob that changes the math, in one graph: each variant is a
    # compile. The two attention-scale flags are independent in transformers
    # (1/sqrt(d) on or off, then 1/(layer+1)), so off-and-layer-scaled checks
    # both; `test_activation_matches_transformers` covers every activation,
    # this variant that the config's choice reaches the graph.
    "relu-untied-padded-unscaled-layer-scaled": dict(
        TINY,
        activation_function="relu",
        scale_attn_weights=False,
        scale_attn_by_inverse_layer_idx=True,
        tie_word_embeddings=False,
        n_inner=96,
        layer_norm_epsilon=1e-3,
        vocab_size=PADDED_VOCAB_SIZE,
    ),
}

LAYOUTS = ("hub", "transformers-sharded")


TIERS = ("unit", "model", "serve", "fuzz", "gpu")
"""What a test needs, cheapest first: `python -m pytest -m unit` is the quick tier."""

settings.register_profile(
    "default", derandomize=True, max_examples=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("long", settings.get_profile("default"), max_examples=200)
settings.load_profile("default")
"""The `fuzz` tier's cases are seeded (`derandomize`): the same on every run. The
default profile is the short slice every suite run (and CI) takes; `python -m pytest
-m fuzz --hypothesis-profile long` is the long run."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test has one tier (`@pytest.mark.tier(...)`, the closest wins: a module's
    `pytestmark` unless the test names its own), which becomes its marker for `-m`.
    The `gpu` tier runs where MAX sees an accelerator; elsewhere it is deselected
    (reported as such), not collected as skips."""
    for item in items:
        tier = item.get_closest_marker("tier")
        if tier is None or tier.args[:1] not in [(name,) for name in TIERS]:
            raise pytest.UsageError(f"{item.nodeid}: give it a tier, one of {TIERS}")
        item.add_marker(tier.args[0])
    if accelerator_count() > 0:
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


@pytest.fixture(autouse=True)
def settings_read_afresh() -> Iterator[None]:
    """The package reads its settings once a process (`gpt2_max.settings`); a test
    reads them as its own environment has them."""
    package_settings.cache_clear()
    yield
    package_settings.cache_clear()


def write_variant(folder: Path, variant: str) -> Path:
    """A variant's hub checkpoint. Padded head rows are scaled up so that,
    unmasked, they would win the argmax: a test then shows they are masked."""
    config = GPT2Config(**VARIANTS[variant])
    state = random_state_dict(config)
    if config.vocab_size > GPT2_VOCAB_SIZE:
        state["lm_head.weight"][GPT2_VOCAB_SIZE:] *= 20
    return save_hub_checkpoint(folder, config, state)


@pytest.fixture(scope="session")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, gpt2_max_checkpoint: Path
) -> Callable[[str, str], Path]:
    """The checkpoint folder of a (variant, layout), written once."""
    cache: dict[tuple[str, str], Path] = {("default", "hub"): gpt2_max_checkpoint}

    def get(variant: str, layout: str) -> Path:
        if (variant, layout) not in cache:
            folder = tmp_path_factory.mktemp(f"{variant}-{layout}")
            if layout == "hub":
                cache[variant, layout] = write_variant(folder, variant)
            else:
                model = load_reference(get(variant, "hub"))
                cache[variant, layout] = save_transformers_layout(model, folder, shard=True)
        return cache[variant, layout]

    return get


@pytest.fixture(scope="session")
def hf_models(
    checkpoints: Callable[[str, str], Path], gpt2_max_reference: Reference
) -> Callable[[str], GPT2LMHeadModel]:
    """The reference model of a variant: transformers reading its hub checkpoint."""
    cache: dict[str, GPT2LMHeadModel] = {"default": gpt2_max_reference.model}

    def get(variant: str) -> GPT2LMHeadModel:
        if variant not in cache:
            cache[variant] = load_reference(checkpoints(variant, "hub"))
        return cache[variant]

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


@pytest.fixture(scope="session")
def generator(checkpoints: Callable[[str, str], Path]) -> Iterator[Generator]:
    """One in-process generator on the default variant, for every generator test.

    It shares the default variant's graph (and so its compile) with `max_models`.
    """
    with Generator(checkpoints("default", "hub"), device="cpu", max_batch_size=8) as loaded:
        yield loaded


QUANTIZED = dict(n_embd=256)
"""K-quant blocks hold 256 values, so rows (n_embd, 4 * n_embd) must be multiples of 256."""


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
    """A reference model whose rows k-quants can block (`QUANTIZED`)."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("quantized"), **QUANTIZED)
    return load_reference(folder)


XL_ROWS = dict(n_embd=320, n_head=5)
"""Rows of 320 values, as gpt2-xl's 1600 no multiple of 256: a k-quant mix then writes
its projections over `n_embd` in the fallback types (Q5_0, Q5_1, Q8_0), those over
`4 * n_embd` (1280) still in k-quants."""


@pytest.fixture(scope="session")
def xl_rows_model(tmp_path_factory) -> GPT2LMHeadModel:
    """The xl-shaped reference model (`XL_ROWS`)."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("xl-rows"), **XL_ROWS)
    return load_reference(folder)
