"""Repository-wide pytest setup for the docstring examples (``--doctest-modules``).

The packages' ``Examples`` blocks run with ``torch`` in their namespace and the fused
switch at its default (on), whatever ``MMATTN_FUSED_ATTN`` says for the rest of the suite.
A module whose optional library is missing is not collected, so its examples are skipped
instead of failing on the import (the tests under tests/ skip the same way with
``importorskip``).
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch
from _pytest.doctest import DoctestItem

OPTIONAL = {
    "mmattn/viz": "matplotlib",
    "adapters/audio.py": "torchaudio",
    "adapters/graph.py": "torch_geometric",
    "adapters/image.py": "torchvision",  # image_transform's example
    "mmattn/integrations/timm.py": "timm",
}

collect_ignore = [path for path, library in OPTIONAL.items() if find_spec(library) is None]


@pytest.fixture(autouse=True)
def _doctest_torch(request: pytest.FixtureRequest, doctest_namespace: dict):
    """Doctests see ``torch`` and run with the default fused switch (they show defaults)."""
    doctest_namespace["torch"] = torch
    if not isinstance(request.node, DoctestItem):
        yield
        return
    from mmattn.kernels import dense as _kernel

    with _kernel.fused_attn(True):
        yield
