"""End to end: `max serve` on GGUF folders, a mixed quantized file and broken ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GPT2Config

from gpt2_max.testing.load import LoadRequest, run_load
from gpt2_max.testing.reference import hf_on_gguf_weights, random_prompt, save_gguf
from gpt2_max.testing.server import assert_start_fails, max_serve
from gpt2_max.tokenizer import TOKENIZER_DIR
from gpt2_max.tools.checkpoint import random_hub_state_dict
from gpt2_max.tools.gguf_writer import gguf_tensors, write_tensors

pytestmark = pytest.mark.tier("serve")

MAX_TOKENS = 24


def greedy(url: str, prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    requests = [
        LoadRequest(i, tuple(p), MAX_TOKENS, stream=i % 2 == 1) for i, p in enumerate(prompts)
    ]
    report = run_load(url, requests, concurrency=concurrency)
    assert report.failed == {}
    return [report.completed[r.index] for r in requests]


def test_q4_k_m_mix_answers_8_concurrent_requests(quantized_model, gguf_files, tmp_path):
    """Q4_K, Q5_K and Q6_K matmul weights all run packed (only the token table is
    dequantized, for the gather); the folder holds `gpt2-q4_k_m.gguf`, which MAX finds by name."""
    path = gguf_files(quantized_model, "q4_k_m")
    prompts = [random_prompt(n, seed=200 + n) for n in (1, 6, 17, 30, 64, 100, 150, 250)]
    with max_serve(path.parent, "--max-batch-size", "8", log=tmp_path / "server.log") as server:
        together = greedy(server.url, prompts, concurrency=8)
        alone = greedy(server.url, prompts[:2], concurrency=1)
    log = (tmp_path / "server.log").read_text()
    assert "(Q5_K)" not in log and "attn_qkv" not in log
    assert together[:2] == alone  # batching does not change a request's tokens
    reference = hf_on_gguf_weights(quantized_model, path)
    agree = []
    for prompt, answer in zip(prompts, together, strict=True):
        assert len(answer) == MAX_TOKENS
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + answer])).logits[0]
        predicted = logits[len(prompt) - 1 : -1].argmax(-1).numpy()
        agree.append(predicted == np.asarray(answer))
    top1 = float(np.mean(np.concatenate(agree)))
    print(f"\nq4_k_m served, 8 concurrent: top-1 {top1:.4f}")
    assert top1 >= 0.80  # The bound of the per-encoding parity tests.


def damage(folder, how: str) -> None:
    """Replaces the folder's GGUF with a broken one."""
    (path,) = folder.glob("*.gguf")
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return
    config = GPT2Config.from_pretrained(folder)
    tensors = gguf_tensors(config, random_hub_state_dict(config), "f32")
    if how == "wrong-shape":
        tensors["output_norm.bias"] = (np.zeros(7, np.float32), tensors["output_norm.bias"][1])
    architecture = "llama" if how == "llama" else "gpt2"
    write_tensors(path, config, tensors, "f32", TOKENIZER_DIR, architecture)


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", "IncompleteCheckpointError: gpt2-f32.gguf is truncated: tensor '"),
        ("llama", "this GGUF holds a 'llama' model"),
        ("wrong-shape", "tensor 'output_norm.bias' has shape (7,); the config implies (64,)"),
    ],
)
def test_broken_gguf_stops_the_server_naming_the_problem(hf_models, tmp_path, how, message):
    folder = tmp_path / "broken"
    save_gguf(hf_models("default"), folder, "f32")
    damage(folder, how)
    assert_start_fails(folder, message)
