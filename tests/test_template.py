"""The template proved: the core, copied under another package name without the
optional rooms, serves a checkpoint exactly, even on a MAX release its shims were
not checked against.

A copier renames the folder and, to start, drops the fast paths, the rooms that
extend the model (decode bursts, the runtime policy), the generator, the offline
tools and the test harness (`docs/porting.md`). This test does exactly that
and serves the copy through its own setting for the plain layers
(`<PACKAGE>_LAYERS=plain`), so the porting guide and `names.PACKAGE` cannot drift
from the code: a core module that imported a dropped room, or a name that still
spelled `gpt2_max`, fails here.
"""

from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path

import pytest
from openai import OpenAI

from gpt2_max.names import PACKAGE
from gpt2_max.testing.load import GREEDY
from gpt2_max.testing.reference import random_prompt
from gpt2_max.testing.server import MODEL_NAME, max_serve
from tests.shims.test_release import OTHER_RELEASE, WARNING, fake_max_release

pytestmark = pytest.mark.tier("serve")

COPY = "my_gpt"
OPTIONAL = [
    "generate", "tools", "testing", "kernels", "bursts", "cpu_runtime", "gguf", "sampler",
    "speculate",
    "layers/fast.py", "layers/linear.py", "layers/quantized.py", "layers/embedding.py",
    "layers/kernel_choice.py", "layers/qmatmul.py",
]
"""What `docs/porting.md` says a first port can leave out: the rooms its drawing does
not set in bold (`tests/test_layout.py` holds the two equal), and `layers/`' fast
modules."""


def copy_core(destination: Path) -> Path:
    source = Path(__import__(PACKAGE).__file__).parent
    copy = shutil.copytree(
        source, destination / COPY, ignore=shutil.ignore_patterns("__pycache__")
    )
    for room in OPTIONAL:
        path = copy / room
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return copy


def spells_package(path: Path) -> list[str]:
    """Imports of the original package in `path`, and strings in its code that name
    it; documentation (a string standing as a statement: docstrings, attribute
    docstrings) aside."""
    tree = ast.parse(path.read_text())
    documentation = {
        id(node.value) for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    imported = {
        node.lineno: [node.module or ""] if isinstance(node, ast.ImportFrom)
        else [alias.name for alias in node.names]
        for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    return [
        f"{path.name}:{node.lineno}" for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and PACKAGE in node.value and id(node) not in documentation
    ] + [
        f"{path.name}:{line} imports {PACKAGE}" for line, modules in imported.items()
        if any(module.split(".")[0] == PACKAGE for module in modules)
    ]


def test_the_core_copied_under_another_name_serves_exactly(
    gpt2_max_checkpoint, gpt2_max_reference, tmp_path
):
    copy = copy_core(tmp_path / "src")
    spelled = [hit for path in copy.rglob("*.py") for hit in spells_package(path)]
    assert spelled == [], f"code that spells the package name: {spelled}"
    # And on a MAX release its shims were not checked against, as a copy meets the
    # next MAX: it serves on MAX's own behaviour, saying once which features are off.
    path = [str(fake_max_release(tmp_path / "release")), str(copy.parent)]
    env = {
        "PYTHONPATH": os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        f"{COPY.upper()}_LAYERS": "plain",
    }
    with max_serve(
        gpt2_max_checkpoint, "--max-batch-size", "2", log=tmp_path / "server.log",
        env=env, package=COPY,
    ) as server:
        with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            for seed, length in ((1, 7), (2, 40)):
                prompt = random_prompt(length, seed=9300 + seed)
                choice = client.completions.create(
                    model=MODEL_NAME, prompt=prompt, max_tokens=8, **GREEDY
                ).choices[0]
                assert choice.model_extra["token_ids"] == gpt2_max_reference.greedy(prompt, 8)
    log = (tmp_path / "server.log").read_text()
    assert f"{COPY}: MAX {OTHER_RELEASE} {WARNING}" in log
    assert "decode batches run up to" not in log  # no bursts room, no bursts
