"""pytest plugin: a tiny GPT-2 under `max serve`, once per test session, with its exact answers.

Installing gpt2-max registers this module through the `pytest11` entry point
`gpt2_max`, so any test suite in that environment can ask for:

- `gpt2_max_checkpoint`: the folder of a tiny random-weight GPT-2 (hub layout,
  real tokenizer), written offline;
- `gpt2_max_reference`: a `Reference` (transformers reading that folder) that
  gives the greedy tokens and log-probabilities a correct server returns;
- `gpt2_max_server`: a `ServedGPT2`, one `max serve` of that checkpoint on a
  free loopback port for the whole session, with an openai client;
- `gpt2_max_structured_server`: the same, started (once, when first asked
  for) with `--enable-structured-output`, so `response_format` is served on
  the CPU.

Heavy imports (MAX, torch) wait until a fixture is used, so the plugin costs
nothing to test suites that do not use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from openai import OpenAI

    from gpt2_max.testing.reference import Reference

SERVE_ARGS = ("--max-batch-size", "8")
"""Flags of the session server besides model, host and port."""

STRUCTURED_OUTPUT_ARGS = (*SERVE_ARGS, "--enable-structured-output")
"""Flags of the structured-output session server."""


@dataclass
class ServedGPT2:
    """The session's server, and what it must answer."""

    url: str
    """Base URL, `http://127.0.0.1:PORT`; the OpenAI API is under `/v1`."""
    model: str
    """The name requests give in `model`."""
    pid: int
    """The `max serve` process (leader of its process group)."""
    client: OpenAI
    """An openai client for `url`, without retries."""
    reference: Reference
    """The Hugging Face reference for the served checkpoint."""
    checkpoint: Path
    """The served checkpoint's folder."""
    log: Path
    """The server's output."""
    metrics_url: str = ""
    """Its Prometheus endpoint (MAX's serving metrics)."""


@pytest.fixture(scope="session")
def gpt2_max_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 checkpoint, written once per session."""
    from gpt2_max.testing.reference import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("gpt2-max-checkpoint"))


@pytest.fixture(scope="session")
def gpt2_max_reference(gpt2_max_checkpoint: Path) -> Reference:
    """transformers' reading of `gpt2_max_checkpoint`: the answers to expect."""
    from gpt2_max.testing.reference import Reference, load_reference

    return Reference(load_reference(gpt2_max_checkpoint))


def _served(
    checkpoint: Path, reference: Reference, log: Path, args: tuple[str, ...]
) -> Iterator[ServedGPT2]:
    from openai import OpenAI

    from gpt2_max.testing.server import max_serve

    with max_serve(checkpoint, *args, log=log) as server:
        with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            yield ServedGPT2(
                url=server.url,
                model=server.model,
                pid=server.pid,
                client=client,
                reference=reference,
                checkpoint=checkpoint,
                log=log,
                metrics_url=server.metrics_url,
            )


@pytest.fixture(scope="session")
def gpt2_max_server(
    gpt2_max_checkpoint: Path,
    gpt2_max_reference: Reference,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServedGPT2]:
    """`max serve` of `gpt2_max_checkpoint`, started once and stopped (whole group) at the end."""
    log = tmp_path_factory.mktemp("gpt2-max-serve") / "server.log"
    yield from _served(gpt2_max_checkpoint, gpt2_max_reference, log, SERVE_ARGS)


@pytest.fixture(scope="session")
def gpt2_max_structured_server(
    gpt2_max_checkpoint: Path,
    gpt2_max_reference: Reference,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServedGPT2]:
    """`gpt2_max_server` with `--enable-structured-output`: `response_format` on the CPU."""
    log = tmp_path_factory.mktemp("gpt2-max-serve-structured") / "server.log"
    yield from _served(gpt2_max_checkpoint, gpt2_max_reference, log, STRUCTURED_OUTPUT_ARGS)
