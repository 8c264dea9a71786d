"""The one version gate of the shims: the MAX releases they were checked against.

Each shim leans on MAX's internals as one release has them, so every shim is
installed on those releases and none on any other: there the package imports and
serves with MAX's own behaviour, and the features the shims carry are off, named in
one warning (`shims.install`). `tests/shims/` re-check every leaned-on name and
behaviour, and fail on a release not listed here, so a new MAX release is checked
before it is added.
"""

from __future__ import annotations

import importlib.metadata

CHECKED_AGAINST = ("26.7.",)
"""MAX releases (version prefixes) every shim was checked against."""


def max_version() -> str:
    """The installed MAX's version."""
    return importlib.metadata.version("max")


def checked(version: str | None = None) -> bool:
    """Whether the shims were checked against `version` (default: the installed MAX)."""
    return (version or max_version()).startswith(CHECKED_AGAINST)
