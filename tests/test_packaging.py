"""The wheel a user installs carries every file the package needs at run time.

README and CI once only installed editable, so a wheel without the Mojo kernel
sources (which every graph compiles) went unnoticed. This builds the wheel the way
`pip install .` does, from a copy of the checkout's files (a stale `build/` in the
checkout cannot hide a missing file), and compares it with what git tracks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpt2_max.testing.server import child_env

pytestmark = pytest.mark.tier("unit")

ROOT = Path(__file__).resolve().parents[1]


def _checkout_files() -> list[str]:
    """Tracked files and untracked ones git does not ignore, as they are on disk."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, text=True, check=True, env=child_env(),
    ).stdout.split("\0")
    return sorted(name for name in set(listed) if name and (ROOT / name).is_file())


def test_wheel_carries_every_package_file(tmp_path: Path) -> None:
    files = _checkout_files()
    source = tmp_path / "source"
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
         str(source)],
        capture_output=True, text=True, env=child_env(),
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("gpt2_max-*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())

    package_files = [name for name in files if name.startswith("gpt2_max/")]
    assert any(name.endswith(".mojo") for name in package_files)
    missing = [name for name in package_files if name not in in_wheel]
    assert not missing, f"{wheel.name} lacks {missing}"
