"""Through `max serve`: a draft changes no greedy token, and a seeded sampled request
repeats.

Two servers of the same weights answer the same requests in the same order, one
without a draft and one with `GPT2_MAX_DRAFT` (the model's weights packed at load):
every greedy answer (token ids, text, finish reason, token count), streamed and not,
must be identical, with a stop token or string, `min_tokens`, `max_tokens` ending
mid-round, a page boundary, the window's end and concurrent rows; rows a draft does
not serve (top-k, top-p, log-probabilities) answer as before. A request sampled at a
temperature takes a draft: asked twice with one seed, alone, it answers the same (its
rounds fall the same way; beside other requests they may not). The log of
the server that drafts every round says drafted tokens were kept, so the rounds ran.
The draft is the model's weights packed at load, or another GPT-2 named by path: the
model cut to its first layer (a cache of another shape), as a checkpoint folder and
as a GGUF file.
"""

from __future__ import annotations

import copy
import re
import subprocess
import time
from pathlib import Path

import pytest
from transformers import GPT2LMHeadModel

from gpt2_max.settings import setting
from gpt2_max.speculate.draft import ENV
from gpt2_max.testing.reference import load_reference, save_gguf, save_transformers_layout
from gpt2_max.testing.server import (
    ONE_KERNEL,
    child_env,
    free_port,
    max_serve,
    serve_command,
    stop_process_group,
)
from tests.bursts.test_served import answers, same_answers

pytestmark = pytest.mark.tier("serve")

SAMPLED = "seeded temperature"
"""The case a draft answers with the model's distribution rather than its tokens."""

ARGS = ("--max-batch-size", "4", "--enable-min-tokens")


DRAFTS = [
    ("float32", "q8_0", "0"),
    ("q4_k_m", "q4_0", "1"),
    ("float32", "first-layer", "0"),
    ("float32", "first-layer.gguf", "0"),
]
"""(the model's weights, the draft, `GPT2_MAX_DRAFT_PACE`): a block type packs the
model's weights; "first-layer" is the model cut to its first layer, a folder or a
q8_0 GGUF file."""


def first_layer(model: GPT2LMHeadModel, folder: Path, gguf: bool) -> Path:
    """`model` with its first block alone, as a checkpoint folder or a GGUF file."""
    cut = copy.deepcopy(model)
    cut.transformer.h = cut.transformer.h[:1]
    cut.config.n_layer = 1
    if gguf:
        return save_gguf(cut, folder, "q8_0")
    return save_transformers_layout(cut, folder)


@pytest.fixture(scope="module")
def plain_answers(checkpoints, quantized_model, gguf_files, tmp_path_factory):
    """The answers of a server without a draft, per weights, asked once."""
    cache: dict[str, tuple[Path, dict]] = {}

    def get(weights: str) -> tuple[Path, dict]:
        if weights not in cache:
            path: Path = (checkpoints("default", "hub") if weights == "float32"
                          else gguf_files(quantized_model, "q4_k_m").parent)
            log = tmp_path_factory.mktemp(f"plain-{weights}") / "server.log"
            with max_serve(path, *ARGS, log=log, env=ONE_KERNEL) as server:
                cache[weights] = (path, answers(server.url, None, again=[SAMPLED]))
        return cache[weights]

    return get


@pytest.fixture(scope="module", params=DRAFTS,
                ids=lambda p: f"{p[0]}-drafted-by-{p[1]}-pace-{p[2]}")
def served(request, plain_answers, tmp_path_factory) -> tuple:
    """(no draft, a draft): the answers of two servers of the same weights, and the
    draft server's log. A draft of a model this small costs what the model does, so the
    pace (`speculate.pace`) mostly turns it off: the servers but one draft every round
    (`GPT2_MAX_DRAFT_PACE=0`), the other drafts as the pace says."""
    weights, draft, pace = request.param
    path, plain = plain_answers(weights)
    logs = tmp_path_factory.mktemp(f"speculate-{weights}-{draft}")
    if draft.startswith("first-layer"):
        draft = str(first_layer(load_reference(path), logs / "draft", draft.endswith(".gguf")))
    env = ONE_KERNEL | {ENV: draft, setting("draft_pace").variable: pace}
    with max_serve(path, *ARGS, log=logs / "server.log", env=env) as server:
        drafted = answers(server.url, plain, again=[SAMPLED])
    return plain, drafted, (logs / "server.log").read_text(), pace == "0", draft


def test_a_draft_changes_no_greedy_answer(served):
    plain, drafted, *_ = served
    same_answers(plain, drafted, skip=[SAMPLED])


def test_a_seeded_sampled_request_repeats_with_a_draft(served):
    _, drafted, *_ = served
    first, again = drafted[SAMPLED, False], drafted[SAMPLED, "again"]
    assert first["tokens"] == again["tokens"] and len(first["tokens"]) == 37


def test_the_draft_server_kept_drafted_tokens(served):
    *_, log, steady, draft = served
    assert "the model keeps what it would have chosen" in log
    if "/" in draft:
        assert f"tokens a round with {draft} (a GPT-2 of 1 layer, 64 wide)" in log
    assert "where the burst sampled" not in log  # MAX took every round's first token
    # Each request's share kept, said as it ended.
    kept = [int(n) for n in re.findall(r"request \S+: (\d+) of \d+ drafted tokens kept", log)]
    if steady:
        assert sum(kept) > 0, kept


UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def planned_cache_bytes(model: Path, log: Path, env: dict[str, str]) -> float:
    """The KV cache's bytes in the memory plan of a `max serve` of `model` whose cache
    the free memory bounds (many rows of full length, a twentieth of the memory),
    read from the line MAX logs; the server is stopped once it has said it."""
    args = serve_command(model, "--port", str(free_port()), "--max-batch-size", "8192",
                         "--device-memory-utilization", "0.05")
    with log.open("w") as out:
        server = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True, env=child_env(**env))
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and server.poll() is None:
            if found := re.search(r"cache_memory: ([\d.]+) (\w+)", log.read_text()):
                return float(found[1]) * UNITS[found[2]]
            time.sleep(0.5)
        raise AssertionError(f"no cache_memory line:\n{log.read_text()[-3000:]}")
    finally:
        stop_process_group(server)


def test_the_memory_planner_leaves_a_self_draft_its_pages(checkpoints, tmp_path):
    # A self-draft's pages have the model's shape, so the model's cache gets about
    # half of what it would without a draft (less the draft's weights, a few MiB).
    model = checkpoints("default", "hub")
    alone = planned_cache_bytes(model, tmp_path / "alone.log", {ENV: ""})
    drafted = planned_cache_bytes(model, tmp_path / "drafted.log", {ENV: "q8_0"})
    assert 0.4 < drafted / alone < 0.52, (drafted, alone)
