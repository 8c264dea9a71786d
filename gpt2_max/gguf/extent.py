"""How long a GGUF file must be, read from its header alone, and which tensor says so.

MAX opens a GGUF with the `gguf` package's reader, which maps the file and takes
a numpy view per tensor; in a truncated file (an interrupted download or copy)
that view runs past the end and the start stops with numpy's words ("When
changing to a larger dtype, its size must be a divisor of ..."), naming neither
the file nor the tensor. This walks the same header (key-value metadata, then
one description per tensor) without touching tensor data, so a cut file is
refused first, by name.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType

from ..weights.files import IncompleteCheckpointError

_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}


class HeaderCut(ValueError):
    """The file ends inside its own header."""


@dataclass(frozen=True)
class TensorExtent:
    name: str
    start: int
    """Byte offset of the tensor's data in the file."""
    end: int
    """One past its last byte."""


class _Cursor:
    """Reads the header's little- or big-endian fields, refusing to read past the end."""

    def __init__(self, buffer: bytes | mmap.mmap, order: str) -> None:
        self.buffer, self.order, self.at = buffer, order, 0

    def take(self, fmt: str, count: int = 1) -> tuple:
        size = struct.calcsize(fmt) * count
        if self.at + size > len(self.buffer):
            raise HeaderCut(f"the header is cut at byte {len(self.buffer)}")
        values = struct.unpack_from(f"{self.order}{count}{fmt}", self.buffer, self.at)
        self.at += size
        return values

    def one(self, fmt: str) -> int | float:
        return self.take(fmt)[0]

    def skip(self, size: int) -> None:
        if self.at + size > len(self.buffer):
            raise HeaderCut(f"the header is cut at byte {len(self.buffer)}")
        self.at += size

    def string(self) -> bytes:
        """A string's bytes, which GGUF defines as UTF-8 (checked: the readers that
        come later decode them, and would fail naming neither the file nor the byte)."""
        length = self.one("Q")
        start = self.at
        self.skip(length)
        text = bytes(self.buffer[start:self.at])
        try:
            text.decode()
        except UnicodeDecodeError as error:
            raise ValueError(f"the string at byte {start} is not UTF-8 ({error.reason})") from None
        return text

    def value(self, kind: int) -> object:
        """A metadata value; arrays are skipped (only `general.alignment` is needed)."""
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, count = self.one("I"), self.one("Q")
            if item in _SCALARS:
                self.skip(struct.calcsize(_SCALARS[item]) * count)
            else:
                for _ in range(count):
                    self.value(item)
            return None
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind} at byte {self.at}")
        return self.one(_SCALARS[kind])


def tensor_extents(buffer: bytes | mmap.mmap) -> list[TensorExtent]:
    """Where each tensor's data lies, from the header in `buffer` (the file's bytes).

    Raises:
        HeaderCut: the bytes end inside the header.
        ValueError: not a GGUF file, or a header this walk cannot read.
    """
    if len(buffer) < 4 or struct.unpack_from("<I", buffer)[0] != GGUF_MAGIC:
        raise ValueError("it does not start with the GGUF magic bytes")
    version = struct.unpack_from("<I", buffer, 4)[0] if len(buffer) >= 8 else 0
    cursor = _Cursor(buffer, "<" if version & 0xFFFF else ">")
    cursor.skip(8)
    tensor_count, kv_count = cursor.take("Q", 2)
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = cursor.string()
        value = cursor.value(cursor.one("I"))
        if key == b"general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    described = []
    for _ in range(tensor_count):
        name = cursor.string().decode()
        dims = cursor.take("Q", cursor.one("I"))
        kind, offset = cursor.one("I"), cursor.one("Q")
        described.append((name, dims, kind, offset))
    data_start = -(-cursor.at // alignment) * alignment
    extents = []
    for name, dims, kind, offset in described:
        if kind not in GGML_QUANT_SIZES:
            continue  # a type no reader knows; the adapter refuses it by name
        block_size, type_size = GGML_QUANT_SIZES[kind]
        elements = 1
        for d in dims:
            elements *= d
        start = data_start + offset
        extents.append(TensorExtent(name, start, start + elements // block_size * type_size))
    return extents


def check_length(path: Path) -> None:
    """Raises `IncompleteCheckpointError` if the GGUF at `path` is shorter than its
    header says (or its header cannot be read), naming the file and the first tensor
    past the end."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size == 0:
            raise IncompleteCheckpointError(f"{path.name} is empty.")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            try:
                extents = tensor_extents(buffer)
            except HeaderCut as cut:
                raise IncompleteCheckpointError(
                    f"{path.name} is truncated: {cut}, before its tensor descriptions end "
                    f"(the file has {size} bytes)."
                ) from cut
            except (ValueError, struct.error) as error:
                raise IncompleteCheckpointError(
                    f"{path.name} has no readable GGUF header ({error})."
                ) from error
    past = [extent for extent in extents if extent.end > size]
    if not past:
        return
    first = min(past, key=lambda extent: extent.start)
    needed = max(extent.end for extent in extents)
    raise IncompleteCheckpointError(
        f"{path.name} is truncated: tensor {first.name!r} occupies bytes "
        f"{first.start}..{first.end}, the file has {size} bytes (its header describes "
        f"{needed} bytes; {len(past)} of {len(extents)} tensors run past the end)."
    )
