"""How the loaded weights are held, read off the state dict the adapter returned.

An adapter decides each tensor's form (`weights/gguf.py`: GGUF blocks stay
packed where MAX or the package has a kernel, F16 matrices stay float16); the model then
builds, for each parameter, a layer that holds it in that form. `WeightPlan`
is that decision as the model sees it, so nothing past `weights/` needs to
know which file format it came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from max.dtype import DType
from max.graph.quantization import QuantizationEncoding


@dataclass(frozen=True)
class WeightPlan:
    """Which parameters are packed blocks and which are floats other than float32."""

    packed: Mapping[str, QuantizationEncoding] = field(default_factory=dict)
    """Parameters held as GGUF blocks (`uint8`), by name, with their encoding."""
    dtypes: Mapping[str, DType] = field(default_factory=dict)
    """Unpacked parameters held in another dtype than float32 (float16), by name."""

    @classmethod
    def of(cls, state_dict: Mapping[str, Any]) -> WeightPlan:
        """The plan of the `WeightData` an adapter returned."""
        return cls(
            packed={
                name: weight.quantization_encoding
                for name, weight in state_dict.items()
                if weight.quantization_encoding is not None
            },
            dtypes={
                name: weight.dtype
                for name, weight in state_dict.items()
                if weight.quantization_encoding is None and weight.dtype != DType.float32
            },
        )

    def encoding(self, name: str) -> QuantizationEncoding | None:
        """The block encoding parameter `name` is packed in, or None for a float one."""
        return self.packed.get(name)

    def dtype(self, name: str) -> DType:
        """The dtype float parameter `name` is held in: float32 unless listed."""
        return self.dtypes.get(name, DType.float32)
