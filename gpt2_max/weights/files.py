"""Refuses weight files shorter than their own header says, before MAX maps them.

MAX memory-maps safetensors files and reads tensors where the header points;
in a truncated file (an interrupted download or copy) that is past the end of
the mapping, and the model worker dies of a segmentation fault with no word
about the file. The header alone tells how long the file must be. Each format
checks its own files (`formats.WeightFormat.check`; GGUF's: `gguf/extent.py`),
raising `IncompleteCheckpointError`; `formats.check_complete` runs each file's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .schema import CAUSAL_MASK_BUFFERS, CheckpointError

HEADER_LENGTH_BYTES = 8
"""A safetensors file starts with its JSON header's length, little-endian u64."""


class IncompleteCheckpointError(ValueError):
    """A weight file ends before the tensors its header lists, or its header is damaged."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
"""GPT-2's tokenizer files, as a checkpoint folder holds them."""
VOCABULARY_FILES = ("tokenizer.json", "vocab.json")
"""The files of those that hold the vocabulary: a folder needs one of them."""


def unreadable_tokenizer_file(folder: Path) -> str | None:
    """What is wrong with the first tokenizer file in `folder` that does not parse (JSON
    files as JSON, `merges.txt` as UTF-8 text), or None if each one there does.
    transformers says which JSON or UTF-8 it could not parse, not in which file."""
    for name in TOKENIZER_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8")
            if name.endswith(".json"):
                json.loads(text)
        except ValueError as error:
            return f"tokenizer file {name} in {folder} cannot be read ({error})"
    return None


@contextmanager
def tokenizer_files_named(model_path: str) -> Iterator[None]:
    """Runs a tokenizer load; where it fails in the folder `model_path`, raises
    `CheckpointError` naming the tokenizer file that does not parse, or, where each
    parses but transformers cannot build a tokenizer from them (a key renamed, a
    value of the wrong type: its error names neither file nor field), the files."""
    try:
        yield
    except Exception as error:
        folder = Path(model_path)
        if not folder.is_dir():
            raise
        if problem := unreadable_tokenizer_file(folder):
            raise CheckpointError(f"{problem}; restore the model's own copy.") from error
        if present := [name for name in TOKENIZER_FILES if (folder / name).is_file()]:
            raise CheckpointError(
                f"the tokenizer files in {folder} ({', '.join(present)}) parse but do not"
                f" make a tokenizer ({type(error).__name__}: {error}); one of them is"
                " damaged: restore the model's own copies."
            ) from error
        raise


SAFETENSORS_DTYPES = frozenset({
    "BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "BF16", "F32",
    "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2",
})
"""The dtype names the safetensors format defines."""


def _check_entry(name: str, entry: object) -> None:
    """Raises `ValueError` unless `entry` describes a tensor as safetensors does."""
    if name == "__metadata__":
        return
    if not isinstance(entry, dict):
        raise ValueError(f"tensor {name!r} is described by {entry!r}, not an object")
    offsets, shape = entry.get("data_offsets"), entry.get("shape")
    if entry.get("dtype") not in SAFETENSORS_DTYPES:
        raise ValueError(f"tensor {name!r} has dtype {entry.get('dtype')!r}, not a safetensors one")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError(f"tensor {name!r} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"tensor {name!r} has data_offsets {offsets!r}")


def safetensors_header(path: Path) -> tuple[int, object]:
    """The length and the parsed JSON of `path`'s header.

    Raises:
        IncompleteCheckpointError: the length field claims a header longer than the
            file (a damaged field, or a file cut inside its header).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        header_length = int.from_bytes(f.read(HEADER_LENGTH_BYTES), "little")
        if HEADER_LENGTH_BYTES + header_length > size:
            raise IncompleteCheckpointError(
                f"{path.name} is damaged or truncated: its first 8 bytes claim a "
                f"{header_length}-byte header, the file has {size} bytes."
            )
        return header_length, json.loads(f.read(header_length))


def safetensors_length(path: Path) -> int:
    """The byte length `path`'s header implies: length field, header, tensor data.

    Raises:
        IncompleteCheckpointError: see `safetensors_header`.
    """
    header_length, header = safetensors_header(path)
    if not isinstance(header, dict):
        raise ValueError(f"the header is {type(header).__name__}, not an object")
    if not set(header) - {"__metadata__"}:
        raise ValueError("the header lists no tensors")
    for name, entry in header.items():
        _check_entry(name, entry)
    data = max(
        (entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
        default=0,
    )
    return HEADER_LENGTH_BYTES + header_length + data


def check_distinct(paths: Iterable[Path]) -> None:
    """Raises `CheckpointError` naming a parameter that two tensors of the safetensors
    files `paths` (checked whole) both hold, under its hub name or transformers' (the
    adapter keeps one of them). MAX reads every safetensors file under a checkpoint
    folder, subfolders too, whatever an index names, and takes each tensor from one of
    them: an older copy left beside the checkpoint was mixed into it, tensor by tensor.
    """
    seen: dict[str, tuple[Path, str]] = {}
    for path in paths:
        for name in safetensors_header(path)[1]:
            if name == "__metadata__":
                continue
            first = seen.setdefault(name.removeprefix("transformer."), (path, name))
            if first != (path, name):
                where = (f"{path} holds both {first[1]!r} and {name!r}" if first[0] == path
                         else f"{first[1]!r} is in both {first[0]} and {path}")
                raise CheckpointError(
                    f"{where}: MAX reads every safetensors file of the folder and each "
                    "tensor from one of them. Keep one copy of the checkpoint there."
                )


HALF_DTYPES = frozenset({"F16", "BF16"})
"""The safetensors dtypes of a checkpoint saved in half precision."""


def holds_half_precision(paths: Iterable[Path]) -> bool:
    """Whether every parameter the safetensors files `paths` hold is float16 or bfloat16
    (`HALF_DTYPES`). The causal-mask buffers older checkpoints carry are not
    parameters: saved beside half-precision weights they are often uint8 or bool, and
    MAX reads a uint8 tensor as a 4-bit float encoding."""
    dtypes = {
        entry["dtype"] for path in paths for name, entry in safetensors_header(path)[1].items()
        if name != "__metadata__"
        and not CAUSAL_MASK_BUFFERS.fullmatch(name.removeprefix("transformer."))
    }
    return bool(dtypes) and dtypes <= HALF_DTYPES


def check_safetensors(path: Path) -> None:
    """Raises `IncompleteCheckpointError` if the safetensors file at `path` is damaged
    or shorter than its header says."""
    try:
        expected = safetensors_length(path)
    except IncompleteCheckpointError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise IncompleteCheckpointError(
            f"{path.name} has no readable safetensors header ({error})."
        ) from error
    size = path.stat().st_size
    if size < expected:
        raise IncompleteCheckpointError(
            f"{path.name} is truncated: its header describes {expected} bytes, "
            f"the file has {size}."
        )
