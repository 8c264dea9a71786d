"""GPT-2's position-wise feed-forward network, and the nonlinearities a config may name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.tensor import Tensor

from ..model_config import GPT2ArchConfig

ACTIVATION_FUNCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * F.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
    "tanh": F.tanh,
    "sigmoid": F.sigmoid,
    "linear": lambda x: x,
}
"""The MLP nonlinearity by the canonical name `model_config.ACTIVATIONS` maps to."""


def activation(name: str, x: Tensor) -> Tensor:
    """The MLP nonlinearity `name` applied to `x`, as transformers computes it."""
    return ACTIVATION_FUNCTIONS[name](x)


class GPT2MLP(Module[[Tensor], Tensor]):
    """Position-wise feed-forward: `c_proj(act(c_fc(x)))`, its projections the layers'."""

    def __init__(self, config: GPT2ArchConfig, layers: Any, layer_idx: int) -> None:
        self.activation = config.activation
        prefix = f"h.{layer_idx}.mlp"
        inner, hidden = config.feed_forward_size, config.hidden_size
        self.c_fc = layers.linear(f"{prefix}.c_fc", hidden, inner)
        self.c_proj = layers.linear(f"{prefix}.c_proj", inner, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(activation(self.activation, self.c_fc(x)))
