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

from ..gguf.adapter import BOS, EOS, check_architecture, huggingface_config, metadata
from ..tokenizer import copy_tokenizer


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
