"""On a MAX release the shims were not checked against, the package still imports and
serves on MAX's own behaviour: no shim installed, every feature they carry off, one
warning naming them. The other release is faked the way Python finds a release: a
`max` distribution of another version ahead of the real one on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2_max.settings import setting
from gpt2_max.testing.server import child_env

pytestmark = pytest.mark.tier("unit")

OTHER_RELEASE = "26.8.0"
WARNING = "is not a release its shims were checked against"


def fake_max_release(folder: Path, version: str = OTHER_RELEASE) -> Path:
    """A folder that, first on `PYTHONPATH`, makes `importlib.metadata` report MAX
    `version` (MAX's code itself is the installed one)."""
    info = folder / f"max-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: max\nVersion: {version}\n")
    return folder


def first_on_path(folder: Path) -> str:
    """A `PYTHONPATH` with `folder` first, then this process's."""
    return os.pathsep.join(p for p in [str(folder), os.environ.get("PYTHONPATH")] if p)


PROBE = """
import gpt2_max.arch  # registers the architecture, as --custom-architectures does
from max.pipelines.lib import PipelineConfig
from max.pipelines.lib.pipeline_variants.text_generation import TextGenerationPipeline
from max.pipelines.sampling import sampling
from max.serve import _tool_call_validation
from max.serve.parser import llama_tool_parser
from max.serve.pipelines.llm import TokenGeneratorPipeline
from max.serve.router import openai_routes
from max.serve.scheduler.text_generation_scheduler import TokenGenerationScheduler
from gpt2_max import shims
from gpt2_max.shims import fast_forward, release, tool_calls
from gpt2_max.tokenizer import GPT2TextTokenizer
from gpt2_max.weights.files import holds_half_precision
from gpt2_max.weights.formats import check_complete

print("version", release.max_version())
print("installed again", shims.install(GPT2TextTokenizer, check_complete, holds_half_precision))
patched = {
    "stop strings": getattr(TokenGeneratorPipeline.next_token_chunk, "cuts_at_stops", False),
    "structured output": getattr(PipelineConfig.from_args, "lifts_cpu_refusal", False),
    "request bodies": getattr(openai_routes._parse_openai_request_body, "checks_bodies", False),
    "weight files": getattr(
        PipelineConfig._model_with_resolved_weights, "checks_weight_files", False),
    "sampler": getattr(TextGenerationPipeline.__init__, "shares_sampler", False),
    "queue": getattr(TokenGenerationScheduler.__init__, "watches_requests", False),
    "min_p": getattr(sampling.topk_fused_sampling, "keeps_min_p", False),
    "echo penalties": getattr(sampling.apply_penalties_to_logits, "on_the_rows", False),
    "echo answers": getattr(openai_routes.OpenAICompletionResponseGenerator.complete, "echoes",
                            False),
    "tool calls": getattr(_tool_call_validation._build_validator, "bounded", False)
    and llama_tool_parser.parse_json_from_text is tool_calls.json_values,
}
print("patched", sorted(name for name, on in patched.items() if on))
print("fast-forward", fast_forward.enabled())
"""


def probe(**env: str) -> subprocess.CompletedProcess[str]:
    """The probe run in a fresh interpreter, with fast-forward asked for."""
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=300,
        env=child_env(**{setting("fast_forward").variable: "1"}, **env),
    )


def test_on_the_checked_release_every_shim_is_installed():
    out = probe()
    assert "installed again True" in out.stdout
    assert "patched ['echo answers', 'echo penalties', 'min_p', 'queue', 'request bodies', " \
        "'sampler', 'stop strings', 'structured output', 'tool calls', 'weight files']" \
        in out.stdout
    assert "fast-forward True" in out.stdout
    assert WARNING not in out.stderr


def test_on_another_release_the_package_imports_with_no_shim_and_one_warning(tmp_path):
    out = probe(PYTHONPATH=first_on_path(fake_max_release(tmp_path)))
    assert f"version {OTHER_RELEASE}" in out.stdout
    assert "installed again False" in out.stdout
    assert "patched []" in out.stdout
    assert "fast-forward False" in out.stdout
    warnings = [line for line in out.stderr.splitlines() if WARNING in line]
    assert len(warnings) == 1, out.stderr
    assert OTHER_RELEASE in warnings[0] and "decode bursts" in warnings[0]
