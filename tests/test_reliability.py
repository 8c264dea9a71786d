"""Serving under load, cancellations and broken checkpoints (`-m slow`; CI runs it).

The load is bounded in count and time, goes to 127.0.0.1 only, and every
completed request is checked token for token against transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from gpt2_max.testing.load import LoadRequest, expected_tokens, plan_requests, run_load
from gpt2_max.testing.reference import TINY, random_prompt
from gpt2_max.testing.server import assert_start_fails, max_serve, tree_rss

pytestmark = pytest.mark.tier("serve")


N_POSITIONS = TINY["n_positions"]
CONCURRENCY = 32


@pytest.fixture(scope="module")
def busy_server(checkpoints, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-load") / "server.log"
    with max_serve(
        checkpoints("default", "hub"), "--max-batch-size", str(CONCURRENCY), log=log
    ) as running:
        yield running


def test_load_with_cancellations_is_exact_and_loses_nothing(busy_server, hf_models):
    requests = plan_requests(
        500, N_POSITIONS, distinct_prompts=60, max_prompt=900, cancellations=50, seed=1
    )
    kept = [r for r in requests if not r.cancel_after_first_token]
    expected = expected_tokens(hf_models("default"), kept, N_POSITIONS)
    warmup = plan_requests(CONCURRENCY, N_POSITIONS, distinct_prompts=8, max_prompt=900, seed=2)
    run_load(busy_server.url, warmup, CONCURRENCY)
    rss_before = tree_rss(busy_server.pid)

    report = run_load(busy_server.url, requests, CONCURRENCY)

    rss_after = tree_rss(busy_server.pid)
    assert report.failed == {}
    assert report.duplicated == []
    assert report.cancelled == 50
    assert sorted(report.completed) == sorted(r.index for r in kept)
    wrong = [i for i in report.completed if report.completed[i] != expected[i]]
    assert wrong == []
    assert rss_after <= 1.10 * rss_before, (rss_before, rss_after)


def test_every_slot_can_fill_the_window_afterwards(busy_server, hf_models):
    """All KV pages came back: a full batch of full-window sequences fits at once."""
    requests = [
        LoadRequest(i, tuple(random_prompt(N_POSITIONS - 24, seed=1000 + i)), 24, stream=False)
        for i in range(CONCURRENCY)
    ]
    report = run_load(busy_server.url, requests, CONCURRENCY)
    assert report.failed == {}
    assert report.completed == expected_tokens(hf_models("default"), requests, N_POSITIONS)


def break_checkpoint(source: Path, target: Path, how: str) -> Path:
    """A copy of `source` damaged in one way."""
    target.mkdir()
    for item in source.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    weights = target / "model.safetensors"
    config = json.loads((target / "config.json").read_text())
    if how == "truncated-file":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "header-length-2-60":
        weights.write_bytes((2**60).to_bytes(8, "little") + weights.read_bytes()[8:])
    elif how in ("missing-tensor", "wrong-shape", "wrong-dtype"):
        state = load_file(str(weights))
        if how == "missing-tensor":
            del state["h.1.attn.c_proj.weight"]
        elif how == "wrong-shape":
            state["ln_f.bias"] = np.zeros(7, np.float32)
        else:
            state["wte.weight"] = state["wte.weight"].astype(np.int32)
        save_file(state, str(weights))
    elif how == "heads-do-not-divide":
        config["n_head"] = 5
    elif how == "cross-attention":
        config["add_cross_attention"] = True
    elif how == "pickle-only":
        weights.rename(target / "pytorch_model.bin")
    (target / "config.json").write_text(json.dumps(config))
    if how == "missing-config":
        (target / "config.json").unlink()
    return target


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated-file", "IncompleteCheckpointError: model.safetensors is truncated"),
        ("header-length-2-60", "model.safetensors is damaged or truncated: its first 8 bytes"),
        ("missing-config", "No config.json"),
        ("missing-tensor", "missing 1 tensor(s), first 'h.1.attn.c_proj.weight'"),
        ("wrong-shape", "'ln_f.bias' has shape (7,); the config implies (64,)"),
        ("wrong-dtype", "'wte.weight' has dtype int32"),
        ("heads-do-not-divide", "n_embd (64) must be divisible by n_head (5)"),
        ("cross-attention", "add_cross_attention"),
        ("pickle-only", "compatible weights cannot be found"),
    ],
)
def test_broken_checkpoint_stops_the_server_naming_the_problem(
    checkpoints, tmp_path, how, message
):
    broken = break_checkpoint(checkpoints("default", "hub"), tmp_path / "broken", how)
    assert_start_fails(broken, message)


def test_max_length_beyond_the_positions_is_refused(checkpoints):
    assert_start_fails(
        checkpoints("default", "hub"),
        f"exceeds the model's max_position_embeddings ({N_POSITIONS})",
        "--max-length", str(2 * N_POSITIONS),
    )


def test_demand_beyond_a_bounded_kv_cache_waits_and_completes(
    busy_server, checkpoints, hf_models, tmp_path
):
    """32 near-full-window requests, all in flight, against a KV cache for 2 windows.

    `--max-batch-total-tokens` sizes the cache (`gpt2_max.memory_planner`)
    instead of the 32 full windows MAX reserves for `--max-batch-size 32`
    (`busy_server`); the scheduler must hold requests back until pages free up,
    none may fail, and the worker must keep serving.
    """
    requests = [
        LoadRequest(i, tuple(random_prompt(900, seed=i)), 100, stream=i % 2 == 1)
        for i in range(CONCURRENCY)
    ]
    with max_serve(
        checkpoints("default", "hub"),
        "--max-batch-size", str(CONCURRENCY), "--max-batch-total-tokens", str(2 * N_POSITIONS),
        log=tmp_path / "server.log",
    ) as server:
        report = run_load(server.url, requests, concurrency=CONCURRENCY)
        again = run_load(server.url, requests[:1], concurrency=1)
    assert report.failed == {}
    expected = expected_tokens(hf_models("default"), requests, N_POSITIONS)
    assert report.completed == expected
    assert again.completed == {0: expected[0]}
    # 2 windows (+ MAX's null page) against 32: well under a tenth of the default.
    assert server.kv_cache_bytes() < busy_server.kv_cache_bytes() / 10
