"""The CPU structured-output shim lifts MAX's refusal for gpt2-max's pipelines only.

These fail on a MAX release that changed the refusal (its message, where it
is raised, or whether it is raised at all), so `release.CHECKED_AGAINST` and the shim are
re-checked then, rather than the shim silently lifting a different check.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from max.pipelines.lib import PipelineArgs, PipelineConfig
from max.pipelines.lib.pipeline_variants.structured_output_backend import make_grammar_backend
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import gpt2_max.arch  # noqa: F401 - registers the architecture and installs the shims
from gpt2_max.shims import structured_output
from gpt2_max.tokenizer import TOKENIZER_DIR, copy_tokenizer

pytestmark = pytest.mark.tier("unit")

ORIGINAL = PipelineConfig.from_args.__wrapped__


def args(model: Path, **flags: object) -> PipelineArgs:
    return PipelineArgs.from_flat_kwargs(
        model_path=str(model), custom_architectures=["gpt2_max"], **flags
    )


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama: an architecture MAX serves with its own tokenizer class."""
    folder = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    copy_tokenizer(folder)
    return folder


def test_maxs_from_args_still_refuses_structured_output_on_the_cpu(
    gpt2_max_checkpoint: Path,
) -> None:
    source = inspect.getsource(ORIGINAL)
    assert f'"{structured_output.REFUSAL}"' in source
    assert 'device_type == "cpu"' in source
    with pytest.raises(ValueError, match=structured_output.REFUSAL):
        ORIGINAL(
            PipelineConfig,
            args(gpt2_max_checkpoint, device_specs="cpu", enable_structured_output=True),
        )


def test_the_patched_from_args_enables_it_for_gpt2_max_on_the_cpu(
    gpt2_max_checkpoint: Path,
) -> None:
    flags = dict(device_specs="cpu", max_batch_size=3)
    config = PipelineConfig.from_args(
        args(gpt2_max_checkpoint, enable_structured_output=True, **flags)
    )
    assert config.sampling.enable_structured_output
    assert config.needs_bitmask_constraints
    assert config.sampling.structured_output_backend == "xgrammar"
    # Everything else resolves as it would without the flag.
    plain = PipelineConfig.from_args(args(gpt2_max_checkpoint, **flags))
    assert config.model_dump(exclude={"sampling"}) == plain.model_dump(exclude={"sampling"})
    assert config.sampling.model_dump(exclude={"enable_structured_output"}) == (
        plain.sampling.model_dump(exclude={"enable_structured_output"})
    )


def test_other_architectures_are_still_refused(llama_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=structured_output.REFUSAL):
        PipelineConfig.from_args(
            args(llama_checkpoint, device_specs="cpu", enable_structured_output=True)
        )
    assert not PipelineConfig.from_args(
        args(llama_checkpoint, device_specs="cpu")
    ).sampling.enable_structured_output


def test_xgrammar_is_the_only_backend_max_offers() -> None:
    """`--structured-output-backend` takes only `xgrammar` in 26.7 (`docs/max-26.7.md`)."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    assert make_grammar_backend("xgrammar", tokenizer, tokenizer.vocab_size).name == "xgrammar"
    with pytest.raises(ValueError, match="supported: 'xgrammar'"):
        make_grammar_backend("llguidance", tokenizer, tokenizer.vocab_size)


def test_the_architecture_has_lifted_the_refusal() -> None:
    assert PipelineConfig.from_args.__func__.lifts_cpu_refusal
