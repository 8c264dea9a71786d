"""The reference's own switches: transformers reads float32 on TF32 tensor cores only
when asked (the GPU tier's float32 peer), and the global switch is left as it was."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from gpt2_max.testing.reference import hf_logprobs

pytestmark = pytest.mark.tier("unit")


@pytest.mark.parametrize("tf32", [False, True])
@pytest.mark.parametrize("before", [False, True])
def test_tf32_is_on_for_the_call_only_when_asked(tf32, before, monkeypatch):
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=50)).eval()
    seen = []
    forward = GPT2LMHeadModel.forward

    def recording(self, *args, **kwargs):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT2LMHeadModel, "forward", recording)
    restore = torch.backends.cuda.matmul.allow_tf32  # a switch monkeypatch cannot undo
    torch.backends.cuda.matmul.allow_tf32 = before
    try:
        hf_logprobs(model, [1, 2, 3], tf32=tf32)
        assert seen == [tf32]
        assert torch.backends.cuda.matmul.allow_tf32 == before
    finally:
        torch.backends.cuda.matmul.allow_tf32 = restore
