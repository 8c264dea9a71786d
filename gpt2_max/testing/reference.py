"""Hugging Face transformers as the reference: tiny random checkpoints and their exact outputs.

A checkpoint is written by `gpt2_max.tools.checkpoint` (the one hub-layout writer)
and read back by transformers, which then says what any server of it must
answer: the greedy tokens of a prompt and their log-probabilities.
`save_transformers_layout` writes the other layout, with transformers itself.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import safetensors.torch
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from gpt2_max.gguf.names import hub_name
from gpt2_max.model_config import GPT2_VOCAB_SIZE, usable_vocab_size
from gpt2_max.tools.checkpoint import (
    TOKENIZER_DIR,
    copy_tokenizer,
    gguf_file_name,
    random_hub_state_dict,
    save_hub_checkpoint,
)
from gpt2_max.tools.gguf_writer import write_gguf
from gpt2_max.weights.schema import is_projection_weight

TINY = dict(n_layer=2, n_embd=64, n_head=4, n_positions=1024)
"""A GPT-2 small enough to compile and run quickly, with the real vocabulary."""

TINY_HEAD64 = dict(TINY, n_embd=256)
"""`TINY` with GPT-2's head size (64), the shape GPU attention kernels are built for."""

REFERENCE_STD = 0.2
"""Weight spread large enough that logits are spread out and greedy choices are
not near-ties, so token-for-token comparisons are meaningful."""


def random_state_dict(
    config: GPT2Config, seed: int = 0, std: float = REFERENCE_STD
) -> dict[str, np.ndarray]:
    """Hub-layout random weights for a reference checkpoint."""
    return random_hub_state_dict(config, seed=seed, std=std)


def write_tiny_checkpoint(
    folder: Path, seed: int = 0, std: float = REFERENCE_STD, **overrides: Any
) -> Path:
    """A random `TINY` GPT-2 (with `overrides`) in hub layout, with the real tokenizer."""
    config = GPT2Config(**{**TINY, **overrides})
    return save_hub_checkpoint(folder, config, random_state_dict(config, seed, std))


def saved_in(folder: Path, dtype: torch.dtype) -> Path:
    """`folder`'s checkpoint with every safetensors tensor saved again in `dtype`, as
    a checkpoint saved in half precision holds them."""
    for path in folder.glob("*.safetensors"):
        state = safetensors.torch.load_file(path)
        safetensors.torch.save_file({name: t.to(dtype) for name, t in state.items()}, path,
                                    metadata={"format": "pt"})
    return folder


def load_reference(folder: Path) -> GPT2LMHeadModel:
    """transformers' own reading of the checkpoint in `folder`, in float32 whatever
    the files hold (transformers would keep a half-precision checkpoint's dtype)."""
    return GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32).eval()


def save_transformers_layout(model: GPT2LMHeadModel, folder: Path, shard: bool = False) -> Path:
    """`save_pretrained` output: `transformer.` keys, optionally sharded with an index."""
    model.save_pretrained(folder, max_shard_size="100KB" if shard else "10GB")
    copy_tokenizer(folder)
    return folder


def sampleable(model: GPT2LMHeadModel) -> int:
    """How many logits a server samples from: the ids the vendored tokenizer knows."""
    return usable_vocab_size(model.config.vocab_size, GPT2_VOCAB_SIZE)


def hf_greedy(
    model: GPT2LMHeadModel, prompt: list[int], new_tokens: int
) -> tuple[list[int], np.ndarray]:
    """Greedy continuation through transformers' own KV cache.

    Returns the tokens and their `[new_tokens, sampleable(model)]` logits.
    """
    vocab = sampleable(model)
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(new_tokens):
            last = out.logits[0, -1, :vocab]
            logits.append(last.numpy().copy())
            tokens.append(int(last.argmax()))
            out = model(
                torch.tensor([[tokens[-1]]]),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    return tokens, np.stack(logits)


@cache
def server_grammar_backend() -> Any:
    """The xgrammar backend `max serve` builds for the vendored GPT-2 tokenizer."""
    from gpt2_max.shims.internals import xgrammar_backend

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    return xgrammar_backend(
        SimpleNamespace(delegate=tokenizer, eos_token_ids={tokenizer.eos_token_id})
    )


def hf_xgrammar_greedy(
    model: GPT2LMHeadModel, prompt: list[int], schema: dict[str, Any], max_tokens: int
) -> list[int]:
    """transformers' greedy under the grammar `max serve` enforces for a `response_format` schema.

    Each step takes the highest logit among the tokens MAX's xgrammar bitmask
    allows, built by the factory the server calls, from the schema as the
    server's tokenizer prepares it; one token a step, the end-of-text token
    included when the grammar closes (as the server reports `token_ids`).
    """
    from gpt2_max.generate.xgrammar_mask import compile_json_schema

    backend = server_grammar_backend()
    matcher = backend.create_matcher(compile_json_schema(backend, schema))
    bitmask = backend.allocate_token_bitmask(1, GPT2_VOCAB_SIZE)
    vocab = sampleable(model)
    tokens: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        while len(tokens) < max_tokens and not matcher.is_stopped():
            backend.fill_next_token_bitmask(matcher, bitmask, 0)
            allowed = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:vocab]
            logits = out.logits[0, -1, :vocab].numpy()
            tokens.append(int(np.where(allowed == 1, logits, -np.inf).argmax()))
            assert matcher.try_consume_tokens(tokens[-1:]) == 1
            out = model(
                torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True
            )
    return tokens


def hf_prompt_logprobs(model: GPT2LMHeadModel, prompt: list[int]) -> list[float]:
    """log P(prompt[i] | prompt[:i]) for i >= 1, as echo with logprobs reports them."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :, : sampleable(model)]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]


def random_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids drawn uniformly from GPT-2's vocabulary."""
    return np.random.default_rng(seed).integers(0, GPT2_VOCAB_SIZE, length).tolist()


@dataclass
class Reference:
    """What a server of `model`'s checkpoint must answer, for a test to assert."""

    model: GPT2LMHeadModel

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """The `new_tokens` greedy (temperature 0) tokens after `prompt`."""
        return hf_greedy(self.model, prompt, new_tokens)[0]

    def greedy_logprobs(self, prompt: list[int], new_tokens: int) -> list[float]:
        """The log-probability of each greedy token, as `logprobs` reports it."""
        tokens, logits = hf_greedy(self.model, prompt, new_tokens)
        logprobs = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1)
        return [float(logprobs[step, token]) for step, token in enumerate(tokens)]


def stopped_text(text: str, stops: list[str]) -> tuple[str, bool]:
    """OpenAI `stop`, read literally: generation halts once the text ends in a stop string.

    Brute force, character by character, independent of `gpt2_max.stop`: the
    text before the first stop to complete (the longer of two that complete
    together), and whether one did.
    """
    for end in range(len(text) + 1):
        done = [len(stop) for stop in stops if stop and text[:end].endswith(stop)]
        if done:
            return text[: end - max(done)], True
    return text, False


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
        if is_projection_weight(name):
            array = array.T
        key = name if name == "lm_head.weight" else f"transformer.{name}"
        params[key] = torch.from_numpy(np.ascontiguousarray(array))
    if model.config.tie_word_embeddings:
        params["lm_head.weight"] = params["transformer.wte.weight"]
    reference.load_state_dict(params)
    return reference


def hf_logprobs(
    model: GPT2LMHeadModel, tokens: list[int], dtype: torch.dtype = torch.float32,
    device: str = "cpu", tf32: bool = False,
) -> np.ndarray:
    """transformers' log-probabilities at every position of `tokens` in one forward pass
    (row `i` is the distribution of token `i + 1`), over `sampleable(model)` ids, with
    the model cast to `dtype` on `device` (a copy, made once) and TF32 off for the
    call unless `tf32`, so float32 is float32. `[len(tokens), sampleable(model)]`,
    float64."""
    key = (id(model), dtype, device)
    if key not in _CASTS:
        _CASTS[key] = (model, copy.deepcopy(model).to(device=device, dtype=dtype))
    cast = _CASTS[key][1]
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        with torch.no_grad():
            logits = cast(torch.tensor([tokens], device=device)).logits[0, :, : sampleable(model)]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    return torch.log_softmax(logits.double(), dim=-1).cpu().numpy()


_CASTS: dict[tuple[int, torch.dtype, str], tuple[GPT2LMHeadModel, GPT2LMHeadModel]] = {}
"""`hf_logprobs`' copies of a model by (its id, dtype, device), each kept with the
model it copies so that the id is not reused."""
