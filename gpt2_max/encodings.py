"""Every weight encoding the package knows, in one table, and the sets read off it.

An encoding is either a `--quantization-encoding` value (it picks the file, the
graph's dtype and the KV cache's) or a GGUF block type a file may hold whatever
the flag says (mixed files are the norm). Which of them stay packed in memory,
which MAX's `qmatmul` multiplies and which the package's kernel decodes are all
properties of the row here; nothing else lists encodings.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf


@dataclass(frozen=True)
class Encoding:
    flag: bool
    """A `--quantization-encoding` value the architecture supports."""
    packed: bool = False
    """GGUF blocks kept packed in memory and multiplied as blocks (CPU only), by the
    package's kernel (`kernels/mojo/kquant.mojo`, specialised on the GGML type id:
    `KERNEL_TYPES`) and, where `flag` (MAX names exactly the block types it
    multiplies), by MAX's CPU `qmatmul` too, whichever `layers.kernel_choice` picks."""


ENCODINGS: dict[str, Encoding] = {
    # The default; F32/F16/BF16 GGUFs and safetensors of any float dtype load under it.
    "float32": Encoding(flag=True),
    # MAX's default on a GPU (it casts a float32 default there); GPU only.
    "bfloat16": Encoding(flag=True),
    "q4_0": Encoding(flag=True, packed=True),
    "q4_k": Encoding(flag=True, packed=True),
    "q6_k": Encoding(flag=True, packed=True),
    # No `--quantization-encoding` value of MAX's; kept packed inside a GGUF and
    # multiplied by the package's kernel. Q5_0, Q5_1 and Q8_0 are what llama.cpp's
    # k-quant mixes write for rows k-quants cannot block by 256 (gpt2-xl's 1600).
    "q5_k": Encoding(flag=False, packed=True),
    "q5_0": Encoding(flag=False, packed=True),
    "q5_1": Encoding(flag=False, packed=True),
    "q8_0": Encoding(flag=False, packed=True),
}

SUPPORTED_ENCODINGS = frozenset(name for name, e in ENCODINGS.items() if e.flag)
"""The architecture's `supported_encodings`."""

BLOCK_FLAGS = frozenset(name for name, e in ENCODINGS.items() if e.flag and e.packed)
"""The `--quantization-encoding` values that are block types, which are the ones MAX's
CPU `qmatmul` multiplies; under them the graph's activations stay float32 (the
encoding's own dtype, uint8, is its packing)."""

PACKED_TYPES = frozenset(name for name, e in ENCODINGS.items() if e.packed)
"""Block types whose matmul weights stay packed when a GGUF holds them."""

KERNEL_TYPES = {
    name: int(gguf.GGMLQuantizationType[name.upper()]) for name in sorted(PACKED_TYPES)
}
"""The packed types with the GGML type id the package's kernel is specialised on."""


def block_geometry(name: str) -> tuple[int, int]:
    """(values, bytes) per block of block type `name`, as ggml defines them."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]]
