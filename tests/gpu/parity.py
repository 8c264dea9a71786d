"""What the tier's tests share: the in-process models' settings, the served tests' greedy
request, and comparisons of the GPU's answers with transformers in float32."""

from __future__ import annotations

import numpy as np
import torch
from openai import OpenAI

from gpt2_max.testing.load import GREEDY
from gpt2_max.testing.reference import hf_logprobs
from gpt2_max.testing.server import MODEL_NAME

TORCH_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where transformers runs the reference (the same card, where torch sees it)."""

IN_PROCESS = {"device_memory_utilization": 0.1, "enable_echo": True}
"""Settings of every in-process model of the tier. Each sizes its KV cache from a tenth
of the card's free memory, not MAX's nine tenths: the tier holds several models,
transformers and a server on one card at once. Each returns all logits, as the tier's
`--enable-echo` server does, so the two share one compiled graph (minutes on a GPU)."""

BFLOAT16_MARGIN = 0.1
"""Above this top-2 margin (transformers float32), bfloat16 must pick transformers' token."""

GPU_STD = 0.05
"""The tier's weight spread. bfloat16's error, and float32's TF32 prefill error, grow
with the spread faster than the margins do: at the CPU suite's `REFERENCE_STD` (0.2)
transformers' own bfloat16 run already picks another token at a step clearer than
`BFLOAT16_MARGIN`; at this one its error stays well under the margin while most steps
remain clear (`benchmarks/results/2026-11-26-gpu-h200-first-bfloat16-run.md`)."""


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def complete(api: OpenAI, prompt: list[int], max_tokens: int, **extra):
    """One greedy completion's first choice, its token ids in `token_ids(choice)`."""
    return api.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, **{**GREEDY, **extra}
    ).choices[0]


def reference_rows(
    reference, prompt: list[int], tokens: list[int], dtype: torch.dtype = torch.float32,
    tf32: bool = False,
) -> np.ndarray:
    """transformers' log-probabilities of the steps that chose `tokens` after `prompt`,
    teacher-forced on those tokens: `[len(tokens), vocab]` (float32 on TF32 tensor
    cores where `tf32`)."""
    sequence = prompt + tokens
    return hf_logprobs(reference, sequence, dtype, TORCH_DEVICE, tf32)[len(prompt) - 1 : -1]


def top2_margins(logprobs: np.ndarray) -> np.ndarray:
    top2 = np.sort(logprobs, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def clear_steps(rows: np.ndarray, tokens: list[int], margin: float) -> tuple[int, int]:
    """Of the steps transformers' `rows` (`reference_rows`) call by more than `margin`,
    how many there are, and at how many `tokens` holds another token than theirs."""
    clear = top2_margins(rows) > margin
    differ = np.array(tokens) != rows.argmax(-1)
    return int(clear.sum()), int((clear & differ).sum())


def assert_clear_tokens_match(reference, prompt, tokens, margin: float = BFLOAT16_MARGIN) -> None:
    tokens = list(tokens)
    clear, differing = clear_steps(reference_rows(reference, prompt, tokens), tokens, margin)
    assert clear >= len(tokens) // 2, f"only {clear} of {len(tokens)} steps are clear choices"
    assert differing == 0, f"{differing} of {clear} clear steps chose another token"
