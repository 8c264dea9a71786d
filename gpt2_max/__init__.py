"""GPT-2 for MAX: `max serve --custom-architectures gpt2_max --model openai-community/gpt2`.

MAX imports this package and registers every `SupportedArchitecture` in
`ARCHITECTURES`; checkpoints whose config names `GPT2LMHeadModel` then run on
`gpt2_max.model.GPT2PipelineModel`. The architecture is imported on first
access, so that `gpt2_max.testing`'s pytest plugin, which every pytest run in
the environment loads, does not import MAX until a fixture needs it.
`gpt2_max.Generator` runs the same model in-process; it too loads on first use,
so `max serve` never imports it (or llguidance).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ARCHITECTURES", "Generator", "gpt2_arch"]


def __getattr__(name: str) -> Any:
    if name == "Generator":
        from .generate import Generator

        return Generator
    if name in __all__:
        from .arch import gpt2_arch

        return {"ARCHITECTURES": [gpt2_arch], "gpt2_arch": gpt2_arch}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
