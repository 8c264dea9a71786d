"""The weight formats the model loads: safetensors in the core, more from rooms.

A format is the name MAX gives it (`WeightsFormat`), the suffix of its files, the
adapter that maps its tensors onto GPT-2's parameters, the check that refuses a
damaged file by name before MAX maps it, and how its file is let go after the
compile. Safetensors is the core's; a room adds another (`gpt2_max.gguf`, through
`extensions.weight_formats`), and a copy that deletes the room serves safetensors
alone.

MAX reads a CPU weight in place for the model's lifetime, so every adapter copies
each tensor out of the file (into huge pages, `hugepages.py`); after compiling,
nothing the model reads lies in the file, and its pages, all touched at load,
would otherwise stay resident beside the copies: `release` lets them go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from max.graph.weights import SafetensorWeights, WeightData, Weights, WeightsFormat

from .. import extensions
from .files import check_safetensors
from .safetensors import convert_safetensor_state_dict


@dataclass(frozen=True)
class WeightFormat:
    """One checkpoint format, as the architecture loads it."""

    name: WeightsFormat
    suffix: str
    """Of the format's files, as MAX finds them in a checkpoint folder."""
    adapter: Callable[..., dict[str, WeightData]]
    """MAX's weight adapter: the file's tensors as GPT-2's parameters."""
    check: Callable[[Path], None]
    """Raises `files.IncompleteCheckpointError`, naming the file, if it is damaged or
    shorter than its header says."""
    weights: type[Weights]
    """The `Weights` MAX opens the format's files as."""
    release: Callable[[Any], None]
    """Lets the file's mapping go, given those `Weights`."""
    float32: bool = False
    """Whether the adapter hands every tensor over in float32 whatever the file holds
    (safetensors: a checkpoint saved in half precision takes twice its files' bytes)."""


SAFETENSORS = WeightFormat(
    name=WeightsFormat.safetensors,
    suffix=".safetensors",
    adapter=convert_safetensor_state_dict,
    check=check_safetensors,
    weights=SafetensorWeights,
    release=SafetensorWeights.close,
    float32=True,
)


def formats() -> tuple[WeightFormat, ...]:
    """Safetensors, then the formats the package's rooms add."""
    return (SAFETENSORS, *extensions.weight_formats())


def held_in_float32(paths: Iterable[Any]) -> bool:
    """Whether the adapters hand every tensor of these weight files over in float32."""
    known = {format.suffix: format for format in formats()}
    suffixes = {Path(path).suffix for path in paths}
    return bool(suffixes) and all(
        suffix in known and known[suffix].float32 for suffix in suffixes
    )


def check_complete(paths: Iterable[Path]) -> None:
    """Raises `IncompleteCheckpointError` naming the first damaged or truncated weight file."""
    known = {format.suffix: format for format in formats()}
    for path in paths:
        if format := known.get(path.suffix):
            format.check(path)


def release(weights: Weights) -> None:
    """Closes the checkpoint's file mapping, or drops its pages where MAX gives no close."""
    # `getattr` would not do: `Weights` answer any attribute with a child.
    for format in formats():
        if isinstance(weights, format.weights):
            format.release(weights)
