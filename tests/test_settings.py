"""The package's settings: read once, each value it cannot use refused by name, and
README's table of them the same as the code's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import gpt2_max
from gpt2_max.names import PACKAGE
from gpt2_max.settings import SETTINGS, Settings, setting, settings

pytestmark = pytest.mark.tier("unit")

README = Path(__file__).parents[1] / "README.md"

GOOD = {
    "layers": [("plain", "plain"), ("Fast", "fast")],
    "fuse_blocks": [("0", False), ("1", True)],
    "packed_kernel": [("max", "max"), ("package", "package")],
    "float16_lines": [("1", True), ("0", False)],
    "worker_nice": [("0", 0), (" 5 ", 5), ("19", 19)],
    "decode_steps": [("1", 1), ("16", 16)],
    "burst_ms": [("100", 100)],
    "fast_forward": [("1", True), ("0", False)],
    "sampler": [("max", "max"), ("Package", "package")],
    "draft": [("q4_0", "q4_0"), ("Q8_0", "q8_0"), ("q4_k", "q4_k"),
              (str(Path(__file__).parent), str(Path(__file__).parent))],
    "draft_tokens": [("1", 1), ("16", 16)],
    "draft_pace": [("0", False), ("1", True)],
}
BAD = {
    "layers": ["fastest", "1"],
    "fuse_blocks": ["yes", "2"],
    "packed_kernel": ["fastest"],
    "float16_lines": ["yes", "lines"],
    "worker_nice": ["20", "-1", "ten", "2.5"],
    "decode_steps": ["0", "-2", "four"],
    "burst_ms": ["0", "1.5", "fast"],
    "fast_forward": ["true", "2"],
    "sampler": ["torch", "1"],
    "draft": ["q4_1", "f16", "yes", "models/no-such-gpt2"],
    "draft_tokens": ["0", "17", "four"],
    "draft_pace": ["on", "2"],
}


def test_every_setting_is_tested_here():
    fields = [s.field for s in SETTINGS]
    assert sorted(GOOD) == sorted(BAD) == sorted(fields)


def test_unset_is_each_default():
    assert Settings.read({}) == Settings(**{s.field: s.default for s in SETTINGS})


@pytest.mark.parametrize("field", sorted(GOOD))
def test_each_value_a_setting_takes_is_read(field):
    variable = setting(field).variable
    assert variable == f"{PACKAGE.upper()}_{field.upper()}"
    for raw, value in GOOD[field]:
        assert getattr(Settings.read({variable: raw}), field) == value


@pytest.mark.parametrize("field", sorted(BAD))
def test_a_value_a_setting_does_not_take_is_refused_naming_it(field):
    variable = setting(field).variable
    for raw in BAD[field]:
        with pytest.raises(ValueError, match=rf"{variable}='{re.escape(raw.strip())}': give "):
            Settings.read({variable: raw})


def test_the_environment_is_read_once(monkeypatch):
    monkeypatch.setenv(setting("burst_ms").variable, "100")
    assert settings().burst_ms == 100
    monkeypatch.setenv(setting("burst_ms").variable, "300")
    assert settings().burst_ms == 100


def readme_table() -> dict[str, tuple[str, str]]:
    """README's table of settings: variable -> (default, what it does)."""
    text = README.read_text()
    section = text[text.index("## Settings"):]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        variable, default, what = (cell.strip() for cell in row.strip("|").split(" | "))
        table[variable.strip("`")] = (default, what)
    return table


def test_readme_lists_every_setting_as_the_code_has_it():
    assert readme_table() == {s.variable: (s.shown, s.what) for s in SETTINGS}


def test_no_module_but_settings_reads_the_environment_for_a_setting():
    """Every `os.environ` or `os.getenv` of the package outside `settings.py` reads
    something that is not one of its settings (MAX's or the system's)."""
    root = Path(gpt2_max.__file__).parent
    readers = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "settings.py" or "testing" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                readers.append(f"{path.relative_to(root)}:{node.lineno}")
    assert readers == []
