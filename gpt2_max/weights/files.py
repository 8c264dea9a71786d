"""Refuses weight files shorter than their own header says, before MAX maps them.

MAX memory-maps safetensors files and reads tensors where the header points;
in a truncated file (an interrupted download or copy) that is past the end of
the mapping, and the model worker dies of a segmentation fault with no word
about the file. A truncated GGUF stops the start with numpy's words instead
(`weights/gguf_extent.py`). The header alone tells how long the file must be.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .gguf_extent import check_gguf_length

HEADER_LENGTH_BYTES = 8
"""A safetensors file starts with its JSON header's length, little-endian u64."""


class IncompleteCheckpointError(ValueError):
    """A weight file ends before the tensors its header lists."""


def safetensors_length(path: Path) -> int:
    """The byte length `path`'s header implies: length field, header, tensor data."""
    with open(path, "rb") as f:
        header_length = int.from_bytes(f.read(HEADER_LENGTH_BYTES), "little")
        header = json.loads(f.read(header_length) or b"{}")
    data = max(
        (entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
        default=0,
    )
    return HEADER_LENGTH_BYTES + header_length + data


def check_complete(paths: Iterable[Path]) -> None:
    """Raises `IncompleteCheckpointError` naming the first truncated weight file."""
    for path in paths:
        if path.suffix == ".gguf":
            if problem := check_gguf_length(path):
                raise IncompleteCheckpointError(problem)
            continue
        if path.suffix != ".safetensors":
            continue
        size = path.stat().st_size
        try:
            expected = safetensors_length(path)
        except (ValueError, KeyError, TypeError, IndexError) as error:
            raise IncompleteCheckpointError(
                f"{path.name} has no readable safetensors header ({error})."
            ) from error
        if size < expected:
            raise IncompleteCheckpointError(
                f"{path.name} is truncated: its header describes {expected} bytes, "
                f"the file has {size}."
            )
