"""`max serve` on the GPU at gpt2-small's shape with MAX's own cache sizing: the server
`bench_gpu.py` starts, which answered its first request on an H200 and died at the
second's first step (`CUDA_ERROR_ILLEGAL_ADDRESS`;
`benchmarks/results/2026-11-26-gpu-h200-second-run-the-head-bug.md`). The tier's tiny
server did not show it. Its graph is the benchmark's (last-position logits), which
`gpu_check.sh` compiles beside the tier.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI

from gpt2_max.testing.load import GREEDY
from gpt2_max.testing.reference import random_prompt, random_state_dict
from gpt2_max.testing.server import MODEL_NAME, max_serve
from gpt2_max.tools.checkpoint import preset_config, save_hub_checkpoint

pytestmark = pytest.mark.tier("gpu")


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> OpenAI:
    folder: Path = tmp_path_factory.mktemp("gpu-serve-gpt2-small")
    config = preset_config("gpt2")
    checkpoint = save_hub_checkpoint(folder / "checkpoint", config, random_state_dict(config))
    with max_serve(
        checkpoint, "--max-batch-size", "64", log=folder / "server.log", devices=None
    ) as server, OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def generated(api: OpenAI, prompt: list[int], max_tokens: int) -> int:
    choice = api.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, **GREEDY
    ).choices[0]
    return len(choice.model_extra["token_ids"])


def test_every_request_after_the_first_is_answered(api):
    # The benchmark's sequence (a short warm-up, then a stream past a KV page), and more.
    for length, max_tokens, seed in ((16, 8, 999), (16, 128, 100), (40, 200, 101), (3, 1, 102)):
        assert generated(api, random_prompt(length, seed=seed), max_tokens) == max_tokens


def test_a_batch_of_concurrent_requests_is_answered(api):
    prompts = [random_prompt(16, seed=200 + i) for i in range(16)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        counts = list(pool.map(lambda prompt: generated(api, prompt, 64), prompts))
    assert counts == [64] * len(prompts)
