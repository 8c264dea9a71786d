"""The Mojo kernel package compiled once per source and MAX version, kept in MAX's cache.

MAX compiles a Mojo source folder given as a custom extension on every declaration,
in every process (`mojo precompile`, seconds on a small CPU), into a temporary file
keyed by the folder's path only. A compiled package (`.mojoc`) named by a hash of
the sources and the MAX version is reused by every later start; a changed kernel
or another MAX gets its own.
"""

from __future__ import annotations

import functools
import hashlib
import os
from importlib.metadata import version
from pathlib import Path

from mojo.paths import MojoCompilationError
from mojo.run import subprocess_run_mojo

from ..max_cache import max_cache_dir
from ..names import PACKAGE


def source_hash(package: Path) -> str:
    """A digest of every Mojo source in `package` (names and contents) and MAX's version."""
    digest = hashlib.sha256(version("max").encode())
    for path in sorted(package.rglob("*.mojo")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def compiled_package(package: Path) -> Path:
    """`package` compiled, from MAX's cache folder if an earlier process compiled it."""
    target = max_cache_dir() / PACKAGE / f"{package.name}_{source_hash(package)}.mojoc"
    if target.is_file():
        return target
    # Compiled under its final name (the compiler bakes the module name from it) in
    # a private folder, then renamed into place: a concurrent start never sees half.
    staging = target.parent / f".staging.{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    try:
        command = ["precompile", str(package), "-o", str(staging / target.name)]
        result = subprocess_run_mojo(command, capture_output=True)
        if result.returncode:
            raise MojoCompilationError(
                package, command, result.stdout.decode(), result.stderr.decode()
            )
        os.replace(staging / target.name, target)
    finally:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()
    return target
