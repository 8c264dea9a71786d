"""Writes a random-weight GPT-2 checkpoint, so MAX can serve GPT-2 with no network.

    gpt2-max-checkpoint ./gpt2-random --preset gpt2
    gpt2-max-checkpoint ./gpt2-q4 --preset gpt2 --format gguf --type q4_k_m

The folder has what a hub GPT-2 repository has: `config.json`, `model.safetensors`
in the original hub layout (bare keys, `Conv1D` weights stored `[in, out]`,
`h.N.attn.bias` mask buffers) and the real GPT-2 tokenizer, vendored in
`gpt2_max/gpt2_tokenizer`. Only the weights are random, so the text is noise but
every shape, code path and cost is that of the real model.

With `--format gguf` the folder holds one llama.cpp-style file instead,
`gpt2-<type>.gguf`, with the same random weights (and the tokenizer in its
metadata); `convert_to_gguf` turns an existing safetensors folder into one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file
from transformers import GPT2Config

from ..tokenizer import TOKENIZER_DIR, copy_tokenizer
from ..weights.schema import expected_shapes, hub_shape
from . import gguf_config, gguf_writer

PRESETS: dict[str, dict[str, int]] = {
    "distilgpt2": dict(n_layer=6, n_embd=768, n_head=12),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25),
}
"""The GPT-2 family's shapes; all share the vocabulary and the 1024 positions."""


def random_hub_state_dict(
    config: GPT2Config, seed: int = 0, std: float = 0.02
) -> dict[str, np.ndarray]:
    """Random float32 parameters for `config`, keyed and laid out as on the hub.

    Normal(0, `std`) everywhere, except LayerNorm scales, which are 1 + that.
    """
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in expected_shapes(config).items():
        values = rng.normal(0.0, std, size=hub_shape(name, shape)).astype(np.float32)
        is_norm_scale = name.split(".")[-2].startswith("ln_") and name.endswith(".weight")
        state[name] = (1.0 + values).astype(np.float32) if is_norm_scale else values
    return state


def save_hub_checkpoint(folder: Path, config: GPT2Config, state: dict[str, np.ndarray]) -> Path:
    """Writes `state` (hub keys and layout) as a hub GPT-2 repository into `folder`.

    The `h.N.attn.bias` causal-mask buffers that original hub checkpoints carry
    are added, so every reader of this layout meets them.
    """
    folder.mkdir(parents=True, exist_ok=True)
    config.architectures = ["GPT2LMHeadModel"]
    config.to_json_file(folder / "config.json")
    causal_mask = np.tril(np.ones((config.n_positions,) * 2, dtype=np.float32))[None, None]
    masks = {f"h.{i}.attn.bias": causal_mask for i in range(config.n_layer)}
    save_file(state | masks, str(folder / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(folder)
    return folder


def write_checkpoint(
    folder: Path, config: GPT2Config, seed: int = 0, std: float = 0.02
) -> Path:
    """Writes config, random hub-layout weights and tokenizer into `folder`."""
    return save_hub_checkpoint(folder, config, random_hub_state_dict(config, seed=seed, std=std))


def gguf_file_name(file_type: str) -> str:
    """`gpt2-<type>.gguf`: MAX reads the encoding of a GGUF from its file name too."""
    return f"gpt2-{file_type}.gguf"


def write_gguf_checkpoint(
    folder: Path, config: GPT2Config, file_type: str, seed: int = 0, std: float = 0.02
) -> Path:
    """Writes the same random weights as `write_checkpoint` as one GGUF file in `folder`,
    with the `config.json` and tokenizer files MAX needs beside it (from its metadata)."""
    path = gguf_writer.write_gguf(
        folder / gguf_file_name(file_type),
        config,
        random_hub_state_dict(config, seed=seed, std=std),
        file_type,
        TOKENIZER_DIR,
    )
    gguf_config.write_companion_files(path)
    return path


def convert_to_gguf(folder: Path, path: Path, file_type: str) -> Path:
    """Converts a safetensors GPT-2 folder (`config.json`, `model.safetensors`,
    either key layout) into a GGUF file of `file_type` (`gguf_writer.FILE_TYPES`) at `path`."""
    config = GPT2Config.from_json_file(folder / "config.json")
    tokenizer_dir = folder if (folder / "vocab.json").exists() else TOKENIZER_DIR
    state = load_file(str(folder / "model.safetensors"))
    return gguf_writer.write_gguf(path, config, state, file_type, tokenizer_dir)


def preset_config(preset: str, **overrides: object) -> GPT2Config:
    """The `GPT2Config` of a GPT-2 family member, with `overrides` applied."""
    return GPT2Config(**{**PRESETS[preset], **overrides})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write the checkpoint")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpt2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.02, help="weight init std")
    parser.add_argument("--format", choices=("safetensors", "gguf"), default="safetensors")
    parser.add_argument(
        "--type", choices=sorted(gguf_writer.FILE_TYPES), default="f32",
        help="GGUF tensor types (with --format gguf)",
    )
    args = parser.parse_args(argv)
    config = preset_config(args.preset)
    if args.format == "gguf":
        path = write_gguf_checkpoint(args.folder, config, args.type, seed=args.seed, std=args.std)
        print(f"wrote a random-weight {args.preset} {args.type} GGUF to {path}")
        return
    folder = write_checkpoint(args.folder, config, seed=args.seed, std=args.std)
    print(f"wrote a random-weight {args.preset} checkpoint to {folder}")


if __name__ == "__main__":
    main()
