"""The package's house: every import points down a floor, and the core stands alone.

`FLOORS` is the layout `docs/porting.md` draws, read from it, lowest first. A module may
import from its own room or a lower floor, never a higher one, so there are no
loops between rooms, and MAX's serving path (`gpt2_max.arch`) loads neither the
fast paths' kernels, the in-process generator nor the offline tools.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpt2_max
from gpt2_max.testing.server import child_env
from tests.test_template import OPTIONAL

pytestmark = pytest.mark.tier("unit")

PACKAGE = Path(gpt2_max.__file__).parent

PORTING = Path(__file__).parents[1] / "docs" / "porting.md"


def drawn_floors() -> list[set[str]]:
    """The rooms of each floor as `docs/porting.md` draws them, lowest first: the rows
    of its first code block under the header, `floor  rooms  what lives there`, the
    columns two or more spaces apart and a room's `.py` or `/` dropped."""
    text = PORTING.read_text()
    start = text.index(" floor  rooms")
    rows = text[start: text.index("```", start)].splitlines()[1:]
    floors: dict[int, set[str]] = {}
    for row in rows:
        number, rooms, _ = re.split(r"\s{2,}", row.strip(), maxsplit=2)
        names = rooms.replace("*", "").split()
        floors[int(number)] = {n.removesuffix(".py").removesuffix("/") for n in names}
    assert sorted(floors) == list(range(len(floors))), "floors numbered 0, 1, 2, ..."
    return [floors[i] for i in range(len(floors))]


FLOORS = drawn_floors()
"""Rooms (top-level modules and subpackages of gpt2_max), floor by floor."""


def drawn_core() -> set[str]:
    """The rooms the drawing sets in bold (`**...**`, several rooms to a pair)."""
    text = PORTING.read_text()
    start = text.index(" floor  rooms")
    drawing = text[start: text.index("```", start)]
    bold = " ".join(re.findall(r"\*\*(.+?)\*\*", drawing)).split()
    return {name.removesuffix(".py").removesuffix("/") for name in bold}


def room(module: str) -> str:
    """`weights` for `gpt2_max.weights.schema`, `gpt2` for `gpt2_max.gpt2`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor(module: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room(module) in rooms)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The gpt2_max modules `path` imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    return {m for m in found if m == "gpt2_max" or m.startswith("gpt2_max.")}


def test_every_room_is_on_a_floor() -> None:
    rooms = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()}
    rooms = {r for r in rooms if not r.startswith(("_", ".")) or r == "__init__"}
    rooms -= {"gpt2_tokenizer"}  # data, not code
    assert rooms <= set().union(*FLOORS), rooms - set().union(*FLOORS)


def test_the_rooms_the_template_drops_are_the_ones_not_in_bold() -> None:
    dropped = {room for room in OPTIONAL if "/" not in room}
    assert dropped == set().union(*FLOORS) - drawn_core()


def test_no_import_points_up_a_floor() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        for target in imports(path):
            if room(target) == room(source) or target == "gpt2_max":
                continue
            if floor(target) >= floor(source):
                upward.append(f"{source} -> {target}")
    assert not upward, upward


def test_serving_loads_no_fast_path_generator_or_tool_until_a_graph_is_built() -> None:
    """What `--custom-architectures gpt2_max` imports in both of MAX's processes."""
    loaded = subprocess.run(
        [sys.executable, "-c",
         "import sys, gpt2_max.arch; print(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, env=child_env(),
    ).stdout.split()
    for absent in ("gpt2_max.layers.fast", "gpt2_max.kernels", "gpt2_max.generate",
                   "gpt2_max.tools", "gpt2_max.testing", "llguidance"):
        assert absent not in loaded
