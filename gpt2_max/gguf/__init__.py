"""GGUF checkpoints: llama.cpp's files of GPT-2, float or block-quantized.

A room of its own (`extensions.ROOMS`): it adds one weight format to the core's
safetensors (`weights.formats`), and a copy that deletes this folder serves
safetensors alone. What is here:

- `adapter.py`: llama.cpp's tensors onto GPT-2's parameters, checked against
  `config.json`; float16 and the block types the layers multiply kept as the file
  holds them, other types dequantized at load; the file's pages let go after the
  compile.
- `extent.py`: a GGUF shorter than its header says, refused by name before MAX's
  reader maps it.
- `names.py`: llama.cpp's tensor names, both ways; `quants.py`: the K-quant block
  writers (the offline writer in `tools/` and the kernel timing in `layers/` use them).
"""

from max.graph.weights import GGUFWeights, WeightsFormat

from ..weights.formats import WeightFormat
from .adapter import convert_gguf_state_dict, head_is_table, held_bytes, release_pages
from .extent import check_length

WEIGHT_FORMAT = WeightFormat(
    name=WeightsFormat.gguf,
    suffix=".gguf",
    adapter=convert_gguf_state_dict,
    check=check_length,
    weights=GGUFWeights,
    release=release_pages,
    held=held_bytes,
    head_is_table=head_is_table,
)
