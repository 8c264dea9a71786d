"""GPT-2 for MAX: `max serve --custom-architectures gpt2_max --model openai-community/gpt2`.

MAX imports this package and registers every `SupportedArchitecture` in
`ARCHITECTURES`; checkpoints whose config names `GPT2LMHeadModel` then run on
`gpt2_max.model.GPT2Model`. `gpt2_max.Generator` runs the same model in-process.
"""

from .arch import gpt2_arch

ARCHITECTURES = [gpt2_arch]

__all__ = ["ARCHITECTURES", "Generator", "gpt2_arch"]


def __getattr__(name: str) -> object:
    # `max serve` imports this package for ARCHITECTURES only; the in-process
    # generator (and llguidance with it) loads on first use.
    if name == "Generator":
        from .generator import Generator

        return Generator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
