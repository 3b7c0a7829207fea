"""pyproject.toml and constraints.txt: the floors are the documented ones, the pins lie above
them, and no dependency is there for a side effect (issue 22, item 10)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the check needs no more than that

ROOT = Path(__file__).resolve().parents[1]
#: The floors and where docs/decisions.md ("Packaging") says why.
FLOORS = {"torch": "2.5.1", "torchvision": "0.20.1", "torchaudio": "2.5.1",
          "torch-geometric": "2.5.3", "einops": "0.8.0", "timm": "1.0.28",
          "transformers": "5.0.0"}


def _requirements() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    found = {}
    for line in lines:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(?:>=\s*([0-9.]+))?.*", line)
        assert match, line
        found[match.group(1).lower()] = match.group(3) or ""
    return found


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_floors_are_the_documented_ones_and_the_pins_lie_above():
    floors = _requirements()
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split("\n")
                if "==" in line)
    decisions = (ROOT / "docs" / "decisions.md").read_text("utf-8")
    for name, floor in FLOORS.items():
        assert floors[name] == floor, f"{name}>={floors[name]}, documented {floor}"
        assert _version(pins[name]) >= _version(floor), f"{name}=={pins[name]} < {floor}"
        assert re.search(rf"\| {name} \| {re.escape(floor)} \|", decisions), name
    python = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    assert python["requires-python"] == ">=3.10" and "| Python | 3.10 |" in decisions


def test_no_font_bundle_among_the_dependencies():
    names = set(_requirements())
    assert not {n for n in names if "font" in n}, "viz uses the system's CJK fonts"
    assert "font" not in (ROOT / "constraints.txt").read_text().lower()


def test_the_floor_venv_installs_exactly_the_declared_floors():
    """make test-floor pins what pyproject declares (tools/floors.py), so they cannot drift."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import floors as tool
    finally:
        sys.path.pop(0)
    pins = dict(line.split("==") for line in tool.floors(["vision", "audio", "graph", "timm",
                                                           "hf"]))
    for name, floor in FLOORS.items():
        assert pins[name] == floor, name
    assert tool.tool_pins(["pytest"]) == [
        line for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.startswith("pytest==")]
    with pytest.raises(ValueError, match="without a floor"):
        tool.floors([], {"name": "x", "dependencies": ["torch"], "optional-dependencies": {}})
