"""llama.cpp's GPT-2 tensor names, both ways (one table for writer and loader).

The module tree of `gpt2.GPT2` keeps the Hugging Face hub names, so a hub name
is also a module parameter name.
"""

from __future__ import annotations

import re

HUB_TO_GGUF: dict[str, str] = {
    "wte.weight": "token_embd.weight",
    "wpe.weight": "position_embd.weight",
    "ln_f.weight": "output_norm.weight",
    "ln_f.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
}
"""Names outside the blocks."""

HUB_BLOCK_TO_GGUF: dict[str, str] = {
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
"""`h.N.<name>.weight|bias` <-> `blk.N.<name>.weight|bias`."""

GGUF_TO_HUB = {v: k for k, v in HUB_TO_GGUF.items()}
GGUF_BLOCK_TO_HUB = {v: k for k, v in HUB_BLOCK_TO_GGUF.items()}

_HUB_BLOCK = re.compile(r"h\.(\d+)\.(.+)\.(weight|bias)")
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)")


def _translate(
    name: str, flat: dict[str, str], pattern: re.Pattern[str], block: dict[str, str], prefix: str
) -> str | None:
    if name in flat:
        return flat[name]
    match = pattern.fullmatch(name)
    if not match or match.group(2) not in block:
        return None
    layer, part, kind = match.groups()
    return f"{prefix}.{layer}.{block[part]}.{kind}"


def gguf_name(hub_name: str) -> str:
    """The llama.cpp name of a hub-layout GPT-2 tensor."""
    name = _translate(hub_name, HUB_TO_GGUF, _HUB_BLOCK, HUB_BLOCK_TO_GGUF, "blk")
    if name is None:
        raise KeyError(f"{hub_name!r} is not a GPT2LMHeadModel parameter")
    return name


def hub_name(gguf_tensor: str) -> str | None:
    """The hub (= module parameter) name of a llama.cpp GPT-2 tensor, or None."""
    return _translate(gguf_tensor, GGUF_TO_HUB, _GGUF_BLOCK, GGUF_BLOCK_TO_HUB, "h")


def block_part(hub: str) -> str | None:
    """`attn.c_attn` for `h.3.attn.c_attn.weight`; None outside the blocks."""
    match = _HUB_BLOCK.fullmatch(hub)
    return match.group(2) if match else None
