"""The package's name and the names derived from it, so a copy renames itself in one place."""

from __future__ import annotations

PACKAGE = __name__.partition(".")[0]
"""What `--custom-architectures` and `AutoModel(custom_architectures=...)` name: the
import name of this package (`gpt2_max`, or a copy's own)."""


def env_var(setting: str) -> str:
    """The environment variable of one of the package's settings: `GPT2_MAX_<SETTING>`."""
    return f"{PACKAGE.upper()}_{setting}"
