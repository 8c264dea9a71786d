"""`max serve` on the GPU at gpt2-small's shape with MAX's own cache sizing (no
`--max-batch-total-tokens`): the server `bench_gpu.py` starts, which answered its first
request on an H200 at commit 9828764 and died at the second's first step
(`CUDA_ERROR_ILLEGAL_ADDRESS`;
`benchmarks/results/2026-11-26-gpu-h200-second-run-the-head-bug.md`), and which served
every request on an H100 after the padded head
(`benchmarks/results/2026-11-27-gpu-h100-served-crash-probe.md`). Besides that sequence,
the 200 requests of `served_workload.py`, and the same sequence in-process with prefix
caching and chunked prefill on (`AutoModel` turns both off). The graph is the
benchmark's (last-position logits), which `gpu_check.sh` compiles beside the tier.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from max.pipelines import AutoModel
from openai import OpenAI

from gpt2_max.names import PACKAGE
from gpt2_max.testing.reference import load_reference, random_prompt, random_state_dict
from gpt2_max.testing.server import Server, max_serve
from gpt2_max.tools.checkpoint import preset_config, save_hub_checkpoint

from .parity import GPU_STD, assert_clear_tokens_match, complete, token_ids
from .served_workload import two_hundred_requests

pytestmark = pytest.mark.tier("gpu")


SEQUENCE = ((16, 8, 999), (16, 128, 100), (40, 200, 101), (3, 1, 102))
"""(prompt length, new tokens, prompt seed): the benchmark's warm-up and stream first."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    config = preset_config("gpt2")
    folder = tmp_path_factory.mktemp("gpt2-small")
    return save_hub_checkpoint(folder, config, random_state_dict(config, std=GPU_STD))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory) -> Server:
    log = tmp_path_factory.mktemp("gpu-serve-gpt2-small") / "server.log"
    with max_serve(checkpoint, "--max-batch-size", "64", log=log, devices=None) as server:
        yield server


@pytest.fixture(scope="module")
def api(server) -> OpenAI:
    with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_every_request_after_the_first_is_answered_with_transformers_clear_tokens(
    api, checkpoint
):
    """The crash's sequence, and what the tier's other servers do not check: this
    server's graph (last-position logits only) picks transformers' clear tokens."""
    reference = load_reference(checkpoint)
    for length, max_tokens, seed in SEQUENCE:
        prompt = random_prompt(length, seed=seed)
        tokens = token_ids(complete(api, prompt, max_tokens))
        assert len(tokens) == max_tokens
        assert_clear_tokens_match(reference, prompt, tokens)


def test_a_batch_of_concurrent_requests_is_answered(api):
    prompts = [random_prompt(16, seed=200 + i) for i in range(16)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        counts = list(pool.map(lambda prompt: len(token_ids(complete(api, prompt, 64))), prompts))
    assert counts == [64] * len(prompts)


def test_two_hundred_requests_of_every_kind_are_answered_in_full(server):
    report = asyncio.run(two_hundred_requests(server.url))
    assert report["requests"] == 200
    assert report["failed"] == []
    assert report["seeds_repeated"] == report["seeds"]


def test_the_same_requests_in_process_with_the_servers_cache_settings(checkpoint):
    model = AutoModel(
        str(checkpoint), devices="gpu", max_batch_size=64, custom_architectures=[PACKAGE],
        device_memory_utilization=0.1,  # the server above holds its share of the card
        enable_prefix_caching=True, enable_chunked_prefill=True,  # AutoModel's are off
    )
    try:
        for length, max_tokens, seed in SEQUENCE:
            result = model.generate(
                [random_prompt(length, seed=seed)], max_new_tokens=max_tokens, top_k=1,
                ignore_eos=True,
            )
            assert len(result.sequences[0]) == length + max_tokens
    finally:
        model.close()
