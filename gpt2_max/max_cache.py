"""The folder MAX caches compiled graphs and Mojo packages in, as MAX itself resolves it."""

from __future__ import annotations

import functools
from pathlib import Path

from mojo.run import subprocess_run_mojo


@functools.cache
def max_cache_dir() -> Path:
    """MAX's cache root (`~/.cache/modular`, or `MODULAR_CACHE_DIR`, or `modular.cfg`'s).

    Asks the bundled `mojo` (`--print-cache-location` names its `.mojo_cache`
    inside the root), as MAX's own Mojo importer does, so every way of moving the
    cache is honoured without restating the rules here.
    """
    location = subprocess_run_mojo(
        ["--print-cache-location"], capture_output=True, check=True
    ).stdout.decode().strip()
    return Path(location).parent
