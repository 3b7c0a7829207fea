"""README.md stays true: its Python example runs and prints what its comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_prints_its_comments():
    text = README.read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    expected = [
        line.split("#", 1)[1].split("—")[0].strip()
        for line in block.splitlines()
        if line.startswith("print(")
    ]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(compile(block, str(README), "exec"), {})
    printed = buffer.getvalue().strip().splitlines()
    assert printed == expected


def test_readme_names_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
