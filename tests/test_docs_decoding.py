"""docs/decoding.md stays true: its example runs and prints what its comment says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "decoding.md"


def test_decoding_example_runs_and_prints_its_comment():
    block = re.search(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S).group(1)
    expected = [line.split("#", 1)[1].strip() for line in block.splitlines()
                if line.startswith("print(")]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(compile(block, str(PAGE), "exec"), {})
    assert buffer.getvalue().strip().splitlines() == expected
