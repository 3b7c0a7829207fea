"""Repository-wide pytest setup for the docstring examples (``--doctest-modules``).

The packages' ``Examples`` blocks run with ``torch`` in their namespace. A module whose
optional library is missing is not collected, so its examples are skipped instead of failing
on the import (the tests under tests/ skip the same way with ``importorskip``).
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

OPTIONAL = {
    "mmattn/viz.py": "matplotlib",
    "adapters/audio.py": "torchaudio",
    "adapters/graph.py": "torch_geometric",
    "adapters/image.py": "torchvision",  # image_transform's example
}

collect_ignore = [path for path, library in OPTIONAL.items() if find_spec(library) is None]


@pytest.fixture(autouse=True)
def _doctest_torch(doctest_namespace: dict) -> None:
    doctest_namespace["torch"] = torch
