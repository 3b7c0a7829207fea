"""Whether a pattern is segment-wise, for :mod:`mmattn.kernels.varlen` (flash on the runs).

Axis key: ``b`` batch, ``l`` length.

``P.same(key)`` alone, or with ``& P.causal()`` and/or ``& P.window(w)`` (in any order), is
attention inside each segment: when every segment of a row is one contiguous run, the
compiled mask is exactly varlen_attn over those runs with ``window_size``. The compile keeps
the source (ids with padded tokens as −1, the window); the runs themselves (one host sync)
are built on the first CUDA call that wants them (``kernels.varlen.segment_runs``), never
on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class SegmentSource:
    """A segment-wise pattern's facts: ``ids`` (B, L) (−1: no segment or padding), the
    tokens' ``real`` mask (B, L), and varlen's ``window`` (left, right)."""

    ids: Tensor
    real: Tensor
    window: tuple[int, int]


def _is(pattern: Any, name: str) -> bool:
    """``isinstance`` by class name: the primitives' modules import the compile, which
    imports this one (an import would close the cycle)."""
    return any(cls.__name__ == name and cls.__module__.startswith("mmattn.patterns")
               for cls in type(pattern).__mro__)


def _parts(pattern: Any) -> list:
    if _is(pattern, "And"):
        return [p for part in pattern.parts for p in _parts(part)]
    return [pattern]


def segment_source(pattern: Any, ctx: Any) -> SegmentSource | None:
    """The :class:`SegmentSource` of ``pattern`` on these tokens, or None (not segment-wise)."""
    parts = _parts(pattern)
    same = [p for p in parts if _is(p, "Same")]
    causal = [p for p in parts if _is(p, "Causal")]
    window = [p for p in parts if _is(p, "Window")]
    if len(same) != 1 or len(causal) > 1 or len(window) > 1 or \
            len(same) + len(causal) + len(window) != len(parts):
        return None
    ids = torch.where(ctx.real, same[0].ids(ctx), -1)
    w = window[0].w if window else -1
    return SegmentSource(ids, ctx.real, (w, 0 if causal else w))
