"""Small helpers shared by every module (defined once, imported everywhere)."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def default(value: T | None, fallback: T) -> T:
    """``value`` unless it is None, else ``fallback``."""
    return fallback if value is None else value
