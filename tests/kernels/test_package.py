"""The Mojo package compiles once per source and MAX version, and never at import."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from gpt2_max import kernels
from gpt2_max.kernels import package
from gpt2_max.testing.server import child_env

pytestmark = pytest.mark.tier("unit")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty MAX cache folder, and a count of `mojo` runs."""
    monkeypatch.setattr(package, "max_cache_dir", lambda: tmp_path / "cache")
    package.compiled_package.cache_clear()
    runs = []
    real = package.subprocess_run_mojo
    monkeypatch.setattr(
        package, "subprocess_run_mojo", lambda args, **kw: runs.append(args) or real(args, **kw)
    )
    yield tmp_path / "cache", runs
    package.compiled_package.cache_clear()


@pytest.mark.tier("model")
def test_compiled_once_then_reused_and_recompiled_when_a_source_changes(cache, tmp_path):
    folder, runs = cache
    source = tmp_path / "mojo"
    shutil.copytree(kernels.MOJO_PACKAGE, source)
    first = package.compiled_package(source)
    assert first.parent == folder / "gpt2_max" and first.suffix == ".mojoc"
    assert len(runs) == 1 and first.stat().st_size > 0
    assert list(first.parent.iterdir()) == [first]  # no staging left behind

    package.compiled_package.cache_clear()  # as a new process would start
    assert package.compiled_package(source) == first
    assert len(runs) == 1

    package.compiled_package.cache_clear()
    (source / "skinny.mojo").write_text((source / "skinny.mojo").read_text() + "\n# edited\n")
    second = package.compiled_package(source)
    assert second != first and second.is_file() and len(runs) == 2


@pytest.mark.tier("model")
def test_a_kernel_that_does_not_compile_names_the_error(cache, tmp_path):
    source = tmp_path / "mojo"
    shutil.copytree(kernels.MOJO_PACKAGE, source)
    (source / "skinny.mojo").write_text("this is not mojo\n")
    with pytest.raises(package.MojoCompilationError, match="skinny.mojo"):
        package.compiled_package(source)


def test_importing_the_architecture_compiles_no_mojo():
    """The API process imports the architecture and never builds a graph."""
    script = (
        "import mojo.paths, mojo.run\n"
        "def refuse(*args, **kwargs): raise SystemExit(f'mojo ran at import: {args}')\n"
        "mojo.paths.subprocess_run_mojo = mojo.run.subprocess_run_mojo = refuse\n"
        "import gpt2_max.arch\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=child_env(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
