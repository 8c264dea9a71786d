"""GPT-2 for MAX: `max serve --custom-architectures gpt2_max --model openai-community/gpt2`.

MAX imports this package and registers every `SupportedArchitecture` in
`ARCHITECTURES`; checkpoints whose config names `GPT2LMHeadModel` then run on
`gpt2_max.model.GPT2PipelineModel`.
"""

from .arch import gpt2_arch

ARCHITECTURES = [gpt2_arch]

__all__ = ["ARCHITECTURES", "gpt2_arch"]
