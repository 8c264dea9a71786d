"""Writes what MAX needs beside a GPT-2 GGUF to serve it: `config.json` and tokenizer files.

    gpt2-max-gguf-config models/gpt2/gpt2.Q4_K_M.gguf

MAX 26.7 builds a model's config only from `config.json`, before any plugin code
runs, so a folder holding only a `.gguf` cannot be served. Both files come from
the GGUF's own metadata (the vendored GPT-2 tokenizer where it has none).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from transformers import GPT2Config

from ..gguf.adapter import check_architecture, metadata
from ..tokenizer import copy_tokenizer

BOS, EOS = "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"
GPT2_DEFAULTS = GPT2Config()
"""What a GGUF without tokenizer metadata gets: GPT-2's own vocabulary and special ids."""


def huggingface_config(meta: dict[str, Any], tensor_names: set[str]) -> GPT2Config:
    """The transformers config a llama.cpp GPT-2 GGUF implies.

    GGUF has no fields for `activation_function`, `scale_attn_weights`,
    `scale_attn_by_inverse_layer_idx` or `reorder_and_upcast_attn`; llama.cpp
    computes GPT-2's defaults (tanh GELU, 1/sqrt(head_dim)), and so does this.
    """
    n_embd = int(meta["gpt2.embedding_length"])
    tokens = meta.get("tokenizer.ggml.tokens")
    inner = meta.get("gpt2.feed_forward_length")
    # Stored as float32: its shortest decimal is what was written (1e-05).
    epsilon = np.float32(meta.get("gpt2.attention.layer_norm_epsilon", 1e-5))
    return GPT2Config(
        architectures=["GPT2LMHeadModel"],
        n_layer=int(meta["gpt2.block_count"]),
        n_embd=n_embd,
        n_head=int(meta["gpt2.attention.head_count"]),
        n_inner=None if inner is None else int(inner),  # None: transformers' 4 * n_embd
        n_positions=int(meta["gpt2.context_length"]),
        layer_norm_epsilon=float(str(epsilon)),
        vocab_size=len(tokens) if tokens else GPT2_DEFAULTS.vocab_size,
        bos_token_id=int(meta.get(BOS, GPT2_DEFAULTS.bos_token_id)),
        eos_token_id=int(meta.get(EOS, GPT2_DEFAULTS.eos_token_id)),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def write_tokenizer(meta: dict[str, Any], folder: Path) -> None:
    """GPT-2 tokenizer files from the file's `gpt2` tokenizer, else the vendored ones."""
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if meta.get("tokenizer.ggml.model") != "gpt2" or not tokens or not merges:
        copy_tokenizer(folder)
        return
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    eos = tokens[int(meta.get(EOS, len(tokens) - 1))]
    bos = tokens[int(meta.get(BOS, len(tokens) - 1))]
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": bos,
                "eos_token": eos,
                "unk_token": eos,
                "add_prefix_space": False,
            }
        )
    )


def write_companion_files(path: Path) -> Path:
    """Writes `config.json` and tokenizer files beside the GGUF at `path`."""
    reader = gguf.GGUFReader(path)
    meta = metadata(reader)
    check_architecture(meta)
    config = huggingface_config(meta, {t.name for t in reader.tensors})
    config.to_json_file(path.parent / "config.json")
    write_tokenizer(meta, path.parent)
    return path.parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Writes config.json and tokenizer files beside a GPT-2 GGUF, "
        "so `max serve --model <its folder>` can serve it."
    )
    parser.add_argument("gguf_file", type=Path)
    folder = write_companion_files(parser.parse_args(argv).gguf_file)
    print(f"wrote config.json and tokenizer files to {folder}")


if __name__ == "__main__":
    main()
