"""Small helpers shared by every module (defined once, imported everywhere)."""

from __future__ import annotations

from typing import TypeVar

import torch

from mmattn._features import export_tracing, features

T = TypeVar("T")


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for sizes ``a >= 0``, ``b >= 1``, also on traced sizes (SymInt).

    Written ``(a + b - 1) // b``: on non-negative operands floor and truncation agree, so the
    exported graph is right even where a runtime divides by truncation. The usual
    ``-(-a // b)`` is not: torch.onnx lowers it to ONNX's truncating ``Div``, and ONNX
    Runtime returns ``floor(a / b)`` wherever the two differ.
    """
    return (a + b - 1) // b


def static_int(n: int) -> int:
    """``n`` as a plain int; a traced size (``torch.SymInt`` of a dynamic torch.compile) is
    specialised to its value, with one guard. Written ``len(range(n))``: dynamo specialises a
    range's bounds on every torch, where ``int(n)`` stays symbolic on torch 2.5 (and an
    ``assume_constant_result`` given it then fails to compile) and ``operator.index`` is
    refused there."""
    return len(range(n))


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
    """True while ``torch.export`` traces: ``torch.compiler.is_exporting`` where torch has it
    (feature ``is_exporting``), else :func:`mmattn._features.export_tracing` (strict and
    non-strict export of the torch releases before it)."""
    if features().is_exporting:
        return bool(torch.compiler.is_exporting())
    return export_tracing()
