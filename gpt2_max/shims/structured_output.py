"""`--enable-structured-output` on the CPU, for this package's pipelines only.

MAX 26.7's `PipelineConfig.from_args` ends with a blanket refusal,
`enable_structured_output is not currently supported on CPU.`, although
nothing in its structured-output path is GPU-specific for a model like this
one: the grammar engine (xgrammar, MAX's only `--structured-output-backend`
in 26.7) compiles and matches on the host, the token bitmask is filled by
numpy on the host, and the sampler applies it with the same graph ops on
either device. So for a pipeline whose tokenizer is gpt2-max's, served on the
CPU, the refusal is the only thing in the way.

The patch wraps `from_args` and touches nothing else. When the original
raises exactly that refusal, and the requested architecture's tokenizer is
one of the types installed here, it builds the config again with the flag
off (every other resolution and validation runs unchanged) and returns that
config with the flag back on. Any other error, architecture or device goes
through untouched, and on a GPU the refusal never fires, so MAX's behaviour
there is MAX's.

`max serve` registers `--custom-architectures` before it builds its config, so
the patch is in place for that call. `max generate` and `AutoModel` import
custom architectures inside `from_args` itself, so there the first call is
still MAX's own unless `gpt2_max.arch` was imported before.
"""

from __future__ import annotations

from functools import wraps
from typing import Any

from max.pipelines.lib import PIPELINE_REGISTRY, PipelineConfig
from max.pipelines.modeling.types import PipelineTask

REFUSAL = "enable_structured_output is not currently supported on CPU."
"""The message of MAX's refusal, matched exactly: a changed check is not lifted."""

_TOKENIZER_TYPES: list[type] = []
"""Tokenizer types whose architectures may serve structured output on the CPU."""


def is_ours(args: Any) -> bool:
    """Whether the architecture `args` would run has one of the installed tokenizers."""
    task = None if args.task == PipelineTask.UNDEFINED else args.task
    arch = PIPELINE_REGISTRY.retrieve_architecture(
        args.main_architecture_name, prefer_module_v3=args.runtime.prefer_module_v3, task=task
    )
    return arch is not None and issubclass(arch.tokenizer, tuple(_TOKENIZER_TYPES))


def _with_structured_output(model: Any, enabled: bool) -> Any:
    """`model` (PipelineArgs or PipelineConfig) with the sampling flag set to `enabled`."""
    sampling = model.sampling.model_copy(update={"enable_structured_output": enabled})
    return model.model_copy(update={"sampling": sampling})


def install(tokenizer_type: type) -> None:
    """Lets `tokenizer_type`'s architectures enable structured output on the CPU.

    The first call wraps `PipelineConfig.from_args`; every call adds its tokenizer type.
    """
    if tokenizer_type not in _TOKENIZER_TYPES:
        _TOKENIZER_TYPES.append(tokenizer_type)
    original = PipelineConfig.__dict__["from_args"].__func__
    if getattr(original, "lifts_cpu_refusal", False):
        return

    @wraps(original)
    def from_args(cls: type[PipelineConfig], args: Any) -> PipelineConfig:
        try:
            return original(cls, args)
        except ValueError as refusal:
            if str(refusal) != REFUSAL or not is_ours(args):
                raise
        config = original(cls, _with_structured_output(args, False))
        if config.model.default_device_spec.device_type != "cpu":
            raise ValueError(REFUSAL)
        return _with_structured_output(config, True)

    from_args.lifts_cpu_refusal = True  # type: ignore[attr-defined]
    PipelineConfig.from_args = classmethod(from_args)  # type: ignore[method-assign,assignment]
