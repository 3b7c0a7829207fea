"""Whether a pattern is segment-wise, for :mod:`mmattn.kernels.varlen` (flash on the runs).

Axis key: ``b`` batch, ``l`` length.

``P.same(key)`` alone, or with ``& P.causal()`` and/or ``& P.window(w)`` (in any order), is
attention inside each segment: when every segment of a row is one contiguous run, the
compiled mask is exactly varlen_attn over those runs with ``window_size``. The compile keeps
the source (ids with padded tokens as −1, the window); the runs themselves (one host sync)
are built on the first CUDA call that wants them (:func:`segment_runs`), never on the CPU.
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


def _parts(pattern: Any) -> list:
    from mmattn.patterns._base import And  # (imported by the module that imports this one)

    if isinstance(pattern, And):
        return [p for part in pattern.parts for p in _parts(part)]
    return [pattern]


def segment_source(pattern: Any, ctx: Any) -> SegmentSource | None:
    """The :class:`SegmentSource` of ``pattern`` on these tokens, or None (not segment-wise)."""
    from mmattn.patterns._attributes import Same
    from mmattn.patterns._positions import Causal, Window

    parts = _parts(pattern)
    same = [p for p in parts if isinstance(p, Same)]
    causal = [p for p in parts if isinstance(p, Causal)]
    window = [p for p in parts if isinstance(p, Window)]
    if len(same) != 1 or len(causal) > 1 or len(window) > 1 or \
            len(same) + len(causal) + len(window) != len(parts):
        return None
    ids = torch.where(ctx.real, same[0].ids(ctx), -1)
    w = window[0].w if window else -1
    return SegmentSource(ids, ctx.real, (w, 0 if causal else w))


def segment_runs(mask: Any):
    """``(Runs, window)`` of a SparseMask compiled from a segment-wise pattern with
    contiguous runs (cached on the mask), else None."""
    source = getattr(mask, "segment_source", None)
    if source is None:
        return None
    cached = mask.__dict__.get("_segment_runs")
    if cached is None:
        from mmattn.kernels.varlen import runs

        found = runs(source.ids)
        cached = (found, source.window) if found.contiguous else False
        mask.__dict__["_segment_runs"] = cached
    return cached or None
