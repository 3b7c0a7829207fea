"""Small helpers shared by every module (defined once, imported everywhere)."""

from __future__ import annotations

from typing import TypeVar

import torch

T = TypeVar("T")


def default(value: T | None, fallback: T) -> T:
    """``value`` unless it is None, else ``fallback``."""
    return fallback if value is None else value


def surely(condition: object) -> bool:
    """``condition`` when it is a plain bool; for one on traced sizes (``torch.SymBool``,
    from torch.export or a dynamic torch.compile) True only when it holds for every size,
    so that a shortcut taken on it adds no guard (the general path runs instead)."""
    if isinstance(condition, bool):
        return condition
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(condition)


def exporting() -> bool:
    """True while ``torch.export`` traces (``torch.compiler.is_exporting``; False on torch
    releases older than that function)."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting is not None and is_exporting())
