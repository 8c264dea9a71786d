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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from max.dtype import DType
from max.graph.weights import SafetensorWeights, WeightData, Weights, WeightsFormat

from .. import extensions
from .files import check_distinct, check_safetensors
from .safetensors import convert_safetensor_state_dict
from .schema import parameter_count, ties_word_embeddings


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
    held: Callable[[Sequence[Path], Any], int]
    """Bytes the adapter hands over for these files of a model of that transformers
    config, without reading the values: what the CPU's fast layers hold, which may
    exceed the files (a checkpoint saved in half precision, a table dequantized)."""
    head_is_table: Callable[[Sequence[Path], Any], bool]
    """Whether the LM head of these files and that config is the token table: the
    config's `tie_word_embeddings`, unless the files hold a head of their own."""


def float32_values(paths: Sequence[Path], hf_config: Any) -> int:
    """What the safetensors adapter hands over: every parameter in float32, whatever
    the files hold."""
    return parameter_count(hf_config) * DType.float32.size_in_bytes


def tied_by_config(paths: Sequence[Path], hf_config: Any) -> bool:
    """The config's word: a tied head saved anyway is the table again."""
    return ties_word_embeddings(hf_config)


SAFETENSORS = WeightFormat(
    name=WeightsFormat.safetensors,
    suffix=".safetensors",
    adapter=convert_safetensor_state_dict,
    check=check_safetensors,
    weights=SafetensorWeights,
    release=SafetensorWeights.close,
    held=float32_values,
    head_is_table=tied_by_config,
)


def formats() -> tuple[WeightFormat, ...]:
    """Safetensors, then the formats the package's rooms add."""
    return (SAFETENSORS, *extensions.weight_formats())


def format_of(paths: Sequence[Path]) -> WeightFormat | None:
    """The one format weight files `paths` are all of, or None: none, several, or one
    the package does not read."""
    known = {format.suffix: format for format in formats()}
    suffixes = {path.suffix for path in paths}
    return known.get(suffixes.pop()) if len(suffixes) == 1 else None


def held_bytes(paths: Iterable[Any], hf_config: Any) -> int | None:
    """Bytes the adapters hand over for weight files `paths` of a model of `hf_config`
    (`WeightFormat.held`), or None unless they are of one format the package reads."""
    paths = [Path(path) for path in paths]
    format = format_of(paths)
    return None if format is None else format.held(paths, hf_config)


def head_is_table(paths: Iterable[Any], hf_config: Any) -> bool:
    """Whether the LM head of weight files `paths` of a model of `hf_config` is the
    token table (`WeightFormat.head_is_table`); the config's word for files of no one
    format the package reads."""
    paths = [Path(path) for path in paths]
    format = format_of(paths)
    if format is None:
        return ties_word_embeddings(hf_config)
    return format.head_is_table(paths, hf_config)


def check_complete(paths: Iterable[Path]) -> None:
    """Raises `IncompleteCheckpointError` naming the first damaged or truncated weight
    file, and `CheckpointError` naming a parameter two safetensors tensors hold
    (`files.check_distinct`)."""
    known = {format.suffix: format for format in formats()}
    paths = list(paths)
    for path in paths:
        if format := known.get(path.suffix):
            format.check(path)
    check_distinct(path for path in paths if path.suffix == SAFETENSORS.suffix)


def release(weights: Weights) -> None:
    """Closes the checkpoint's file mapping, or drops its pages where MAX gives no close."""
    # `getattr` would not do: `Weights` answer any attribute with a child.
    for format in formats():
        if isinstance(weights, format.weights):
            format.release(weights)
