"""How the loaded weights are held, read off the state dict the adapter returned.

An adapter decides each tensor's form (`gguf/adapter.py`: GGUF blocks stay
packed where MAX or the package has a kernel, F16 matrices stay float16); the model then
builds, for each parameter, a layer that holds it in that form. `WeightPlan`
is that decision as the model sees it, so nothing past `weights/` needs to
know which file format it came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
from max.dtype import DType
from max.graph import Shape
from max.graph.quantization import QuantizationEncoding
from max.graph.weights import WeightData


@dataclasses.dataclass
class BlockWeightData(WeightData):
    """GGUF blocks of a type MAX's `QuantizationEncoding` does not name (Q5_0, Q5_1,
    Q8_0), which therefore travel as plain `uint8` for MAX; `block_type` says which."""

    block_type: str = ""


def packed_weight(blocks: np.ndarray, name: str, kind: str) -> WeightData:
    """GGUF blocks of type `kind` (`uint8`, one row per output feature) as the weight
    the layers multiply packed: with MAX's `QuantizationEncoding` where it names the
    type, else a `BlockWeightData`."""
    upper = kind.upper()
    shape = Shape(blocks.shape)
    if upper in QuantizationEncoding.__members__:
        return WeightData(blocks, name, DType.uint8, shape, QuantizationEncoding[upper])
    return BlockWeightData(blocks, name, DType.uint8, shape, block_type=kind.lower())


def block_type(weight: WeightData) -> str | None:
    """The block type (`encodings.ENCODINGS`'s name) `weight` is packed in, or None."""
    if isinstance(weight, BlockWeightData):
        return weight.block_type
    encoding = weight.quantization_encoding
    return None if encoding is None else encoding.name.lower()


def unpacked(weight: WeightData) -> WeightData:
    """Packed `weight` (`[out, bytes]`, as the file stores its blocks) dequantized to
    float32 `[out, in]` by the `gguf` package, for layers that multiply floats."""
    kind = block_type(weight)
    assert kind is not None, weight.name
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    values = gguf.quants.dequantize(np.from_dlpack(weight.data), qtype)
    return WeightData.from_numpy(np.ascontiguousarray(values, dtype=np.float32), weight.name)


@dataclass(frozen=True)
class WeightPlan:
    """Which parameters are packed blocks and which are floats other than float32."""

    packed: Mapping[str, str] = field(default_factory=dict)
    """Parameters held as GGUF blocks (`uint8`), by name, with their block type."""
    dtypes: Mapping[str, DType] = field(default_factory=dict)
    """Unpacked parameters held in another dtype than float32 (float16), by name."""
    work: str = "request"
    """What the packed weights' kernels are chosen for (`layers.kernel_choice.WORK`):
    a served model's requests, or a speculative draft's one-row steps ("decode")."""
    few_rows: frozenset[str] = frozenset()
    """Parameters that multiply a few rows a step whatever the work (a last-token LM
    head: each sequence's last rows, at a prefill too), whose kernels are chosen for
    "decode"."""

    @classmethod
    def of(cls, state_dict: Mapping[str, Any]) -> WeightPlan:
        """The plan of the `WeightData` an adapter returned."""
        packed = {name: block_type(weight) for name, weight in state_dict.items()}
        return cls(
            packed={name: kind for name, kind in packed.items() if kind is not None},
            dtypes={
                name: weight.dtype
                for name, weight in state_dict.items()
                if packed[name] is None and weight.dtype != DType.float32
            },
        )

    def work_of(self, name: str) -> str:
        """What parameter `name`'s kernel is chosen for."""
        return "decode" if name in self.few_rows else self.work

    def encoding(self, name: str) -> str | None:
        """The block type parameter `name` is packed in, or None for a float one."""
        return self.packed.get(name)

    def dtype(self, name: str) -> DType:
        """The dtype float parameter `name` is held in: float32 unless listed."""
        return self.dtypes.get(name, DType.float32)
