"""The declared floors of pyproject.toml as exact pins, for ``make test-floor``.

Every ``name>=X`` of the dependencies and of the extras named becomes ``name==X``, so the
floor venv holds exactly what pyproject promises (the two cannot drift); the test tools
(``--tools``) come at their pins from constraints.txt. A requirement without a floor is an
error: a floor that is not stated cannot be tested.

Usage::

    python tools/floors.py --extras vision,audio,graph,timm,hf \
        --tools pytest,pytest-xdist,hypothesis > floors.txt
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_REQUIREMENT = re.compile(r"([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?\s*>=\s*([0-9][0-9.]*)\s*(?:,.*)?")


def _load(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        sys.exit("tools/floors.py needs Python 3.11+ (tomllib) to read pyproject.toml")
    return tomllib.loads(path.read_text("utf-8"))["project"]


def floors(extras: list[str], project: dict | None = None) -> list[str]:
    """``name==X`` for each requirement of the core and of ``extras`` (self-references to
    other extras of this project followed)."""
    project = _load(ROOT / "pyproject.toml") if project is None else project
    lines = list(project["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in project["optional-dependencies"][extra]:
            match = re.fullmatch(rf"{project['name']}\[([^\]]*)\]", line.strip())
            if match:
                todo += [e.strip() for e in match.group(1).split(",")]
            else:
                lines.append(line)
    pins = {}
    for line in lines:
        match = _REQUIREMENT.fullmatch(line.split("#")[0].strip())
        if not match:
            raise ValueError(f"requirement without a floor (name>=X): {line!r}")
        pins[match.group(1).lower()] = f"{match.group(1)}=={match.group(3)}"
    return sorted(pins.values())


def tool_pins(names: list[str], constraints: Path = ROOT / "constraints.txt") -> list[str]:
    """The pins of constraints.txt for ``names``."""
    pinned = {}
    for line in constraints.read_text("utf-8").splitlines():
        if "==" in line and not line.startswith("#"):
            pinned[line.split("==")[0].strip().lower()] = line.strip()
    return [pinned[name.lower()] for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--extras", default="", help="comma-separated extras")
    parser.add_argument("--tools", default="", help="test tools, at their constraints.txt pins")
    args = parser.parse_args()
    split = [part.strip() for part in args.extras.split(",") if part.strip()]
    tools = [part.strip() for part in args.tools.split(",") if part.strip()]
    print("\n".join(floors(split) + tool_pins(tools)))


if __name__ == "__main__":
    main()
