"""Through `max serve`: a draft changes no greedy token, and a seeded sampled request
repeats.

Two servers of the same weights answer the same requests in the same order, one
without a draft and one with `GPT2_MAX_DRAFT` (the model's weights packed at load):
every greedy answer (token ids, text, finish reason, token count), streamed and not,
must be identical, with a stop token or string, `min_tokens`, `max_tokens` ending
mid-round, a page boundary, the window's end and concurrent rows; rows a draft does
not serve (top-k, top-p, log-probabilities) answer as before. A request sampled at a
temperature takes a draft: asked twice with one seed it answers the same. The log of
the server that drafts every round says drafted tokens were kept, so the rounds ran.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpt2_max.settings import setting
from gpt2_max.speculate.draft import ENV
from gpt2_max.testing.server import max_serve
from tests.bursts.test_served import answers, same_answers

pytestmark = pytest.mark.tier("serve")

SAMPLED = "seeded temperature"
"""The case a draft answers with the model's distribution rather than its tokens."""


@pytest.fixture(scope="module", params=[("float32", "q8_0", "0"), ("q4_k_m", "q4_0", "1")],
                ids=lambda p: f"{p[0]}-drafted-by-{p[1]}-pace-{p[2]}")
def served(request, checkpoints, quantized_model, gguf_files, tmp_path_factory) -> tuple:
    """(no draft, a draft): the answers of two servers of the same weights, and the
    draft server's log. A draft of a model this small costs what the model does, so the
    pace (`speculate.pace`) mostly turns it off: one server drafts every round
    (`GPT2_MAX_DRAFT_PACE=0`), the other drafts as the pace says."""
    weights, draft, pace = request.param
    path: Path = (checkpoints("default", "hub") if weights == "float32"
                  else gguf_files(quantized_model, "q4_k_m").parent)
    logs = tmp_path_factory.mktemp(f"speculate-{weights}")
    results = []
    for env in ({}, {ENV: draft, setting("draft_pace").variable: pace}):
        with max_serve(path, "--max-batch-size", "4", "--enable-min-tokens",
                       log=logs / f"server{len(results)}.log", env=env) as server:
            results.append(
                answers(server.url, results[0] if results else None, again=[SAMPLED])
            )
    return (*results, (logs / "server1.log").read_text(), pace == "0")


def test_a_draft_changes_no_greedy_answer(served):
    plain, drafted, *_ = served
    same_answers(plain, drafted, skip=[SAMPLED])


def test_a_seeded_sampled_request_repeats_with_a_draft(served):
    _, drafted, *_ = served
    first, again = drafted[SAMPLED, False], drafted[SAMPLED, "again"]
    assert first["tokens"] == again["tokens"] and len(first["tokens"]) == 37


def test_the_draft_server_kept_drafted_tokens(served):
    *_, log, steady = served
    assert "the model keeps what it would have chosen" in log
    assert "where the burst sampled" not in log  # MAX took every round's first token
    kept = [int(n) for n in re.findall(r"drafts: \d+ row rounds, (\d+) of \d+", log)]
    if steady:
        assert kept and kept[-1] > 0, kept
