"""Lazy imports of the modality libraries, with an install hint when one is missing.

``import adapters`` must work with only torch and einops installed, so no adapter imports
torchvision, torchaudio or torch_geometric at module level; each calls :func:`require` when
it first needs the library.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# library (top-level import name) -> the pip extra that installs it
EXTRAS = {
    "torchvision": "vision",
    "torchaudio": "audio",
    "torch_geometric": "graph",
}


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` (e.g. ``"torchaudio.functional"``) or explain how to install it.

    Args:
        module: dotted module name; its top-level package must be a key of ``EXTRAS``.
        what: the feature that needs it, for the message (e.g. ``"AudioFrameEmbedder"``).

    Returns:
        The imported module.

    Raises:
        ImportError: the library is not installed; the message names the pip extra.
    """
    top = module.split(".")[0]
    extra = EXTRAS[top]
    try:
        importlib.import_module(top)  # a hidden top-level package fails here, even when
        return importlib.import_module(module)  # the submodule is still cached
    except ImportError as err:
        raise ImportError(
            f"{what} needs {top}, which is not installed; install it with "
            f'pip install "mmattn[{extra}]"'
        ) from err
