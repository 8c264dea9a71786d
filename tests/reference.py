"""Hugging Face transformers as the reference: random checkpoints and greedy decoding.

Checkpoints are written by transformers itself (torch, CPU), in the two layouts
`gpt2_max.weights.safetensors` reads, so the tests never depend on our own writer
being right about what a GPT-2 checkpoint looks like.
"""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import GPT2Config, GPT2LMHeadModel

from gpt2_max.checkpoint import TOKENIZER_DIR, copy_tokenizer, gguf_file_name
from gpt2_max.weights.gguf_names import block_part, hub_name
from gpt2_max.weights.gguf_writer import CONV1D, write_gguf

TINY = dict(n_layer=2, n_embd=64, n_head=4, n_positions=1024)
"""A GPT-2 small enough to compile and run quickly, with the real vocabulary."""


def random_hf_model(config: GPT2Config, seed: int = 0, std: float = 0.2) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel with every parameter random, LayerNorms included.

    `std` is large enough that logits are spread out and greedy choices are not
    near-ties, so token-for-token comparisons are meaningful.
    """
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
    return model


def save_transformers_layout(model: GPT2LMHeadModel, folder: Path, shard: bool = False) -> Path:
    """`save_pretrained` output: `transformer.` keys, optionally sharded with an index."""
    model.save_pretrained(folder, max_shard_size="100KB" if shard else "10GB")
    copy_tokenizer(folder)
    return folder


def save_hub_layout(model: GPT2LMHeadModel, folder: Path) -> Path:
    """The original hub layout: bare keys plus `h.N.attn.bias` causal-mask buffers."""
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    state = hub_state(model)
    mask = np.tril(np.ones((config.n_positions,) * 2, dtype=np.float32))[None, None]
    for i in range(config.n_layer):
        state[f"h.{i}.attn.bias"] = mask
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = ["GPT2LMHeadModel"]
    config.to_json_file(folder / "config.json")
    copy_tokenizer(folder)
    return folder


def hub_state(model: GPT2LMHeadModel) -> dict[str, np.ndarray]:
    """The model's parameters under hub names, `[in, out]` Conv1D weights, tied head left out."""
    return {
        key.removeprefix("transformer."): value.detach().numpy().copy()
        for key, value in model.state_dict().items()
        if not (model.config.tie_word_embeddings and key == "lm_head.weight")
    }


def save_gguf(model: GPT2LMHeadModel, folder: Path, file_type: str) -> Path:
    """`model` as a llama.cpp GPT-2 GGUF of `file_type`, in a folder with its
    `config.json` (the fields GGUF cannot carry come from there) and tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config
    path = write_gguf(
        folder / gguf_file_name(file_type), config, hub_state(model), file_type, TOKENIZER_DIR
    )
    config.architectures = ["GPT2LMHeadModel"]
    config.to_json_file(folder / "config.json")
    copy_tokenizer(folder)
    return path


def hf_on_gguf_weights(model: GPT2LMHeadModel, path: Path) -> GPT2LMHeadModel:
    """A copy of `model` whose parameters are the GGUF's, dequantized by `gguf`:
    the reference for quantized files, so only the kernels' arithmetic differs."""
    reference = copy.deepcopy(model)
    params = reference.state_dict()
    for tensor in gguf.GGUFReader(path).tensors:
        name = hub_name(tensor.name)
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if array.ndim == 2 and block_part(name) in CONV1D:
            array = array.T
        key = name if name == "lm_head.weight" else f"transformer.{name}"
        params[key] = torch.from_numpy(np.ascontiguousarray(array))
    if model.config.tie_word_embeddings:
        params["lm_head.weight"] = params["transformer.wte.weight"]
    reference.load_state_dict(params)
    return reference


def hf_greedy(
    model: GPT2LMHeadModel, prompt: list[int], new_tokens: int
) -> tuple[list[int], np.ndarray]:
    """Greedy continuation through transformers' own KV cache: tokens and `[n, vocab]` logits."""
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(new_tokens):
            last = out.logits[0, -1]
            logits.append(last.numpy().copy())
            tokens.append(int(last.argmax()))
            out = model(
                torch.tensor([[tokens[-1]]]),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return tokens, np.stack(logits)


def hf_prompt_logprobs(model: GPT2LMHeadModel, prompt: list[int]) -> list[float]:
    """log P(prompt[i] | prompt[:i]) for i >= 1, as echo with logprobs reports them."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]


def random_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids drawn uniformly from GPT-2's vocabulary."""
    return np.random.default_rng(seed).integers(0, 50257, length).tolist()
