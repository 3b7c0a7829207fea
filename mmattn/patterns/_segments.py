"""Whether a pattern is segment-wise, for :mod:`mmattn.kernels.varlen` (flash on the runs).

Axis key: ``b`` batch, ``l`` length.

``P.same(key)`` alone, or with ``& P.causal()`` and/or ``& P.window(w)`` (in any order), is
attention inside each segment (each of these primitives, and ``&``, give their
:class:`SegmentForm`; every other pattern gives None): when every segment of a row is one
contiguous run, the compiled mask is exactly varlen_attn over those runs with
``window_size``. The compile keeps the source (ids with padded tokens as −1, the window);
the runs themselves (one host sync) are built on the first CUDA call that wants them
(``kernels.varlen.segment_runs``), never on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmattn.kernels.varlen import window_size


@dataclass(frozen=True)
class SegmentForm:
    """What a pattern says of segment-wise attention: the segment ``ids`` (B, L) it compares
    (``P.same``), a ``causal`` rule, a ``window`` w (|q − k| <= w). ``a & b`` joins two forms
    that say different things (:meth:`join`); every other pattern has none."""

    ids: Tensor | None = None
    causal: bool = False
    window: int | None = None

    def join(self, other: SegmentForm | None) -> SegmentForm | None:
        """The form of ``self & other``, or None where both state the same term (two ids,
        two causal rules or two windows: left to the block masks)."""
        if other is None or (self.ids is not None and other.ids is not None) or \
                (self.causal and other.causal) or \
                (self.window is not None and other.window is not None):
            return None
        return SegmentForm(self.ids if self.ids is not None else other.ids,
                           self.causal or other.causal,
                           self.window if self.window is not None else other.window)


@dataclass(frozen=True)
class SegmentSource:
    """A segment-wise pattern's facts: ``ids`` (B, L) (−1: no segment or padding), the
    tokens' ``real`` mask (B, L), and varlen's ``window`` (left, right)."""

    ids: Tensor
    real: Tensor
    window: tuple[int, int]


def segment_source(pattern: Any, ctx: Any) -> SegmentSource | None:
    """The :class:`SegmentSource` of ``pattern`` on these tokens, or None (not segment-wise):
    from the pattern's own :meth:`~mmattn.patterns.Pattern.segment_form`."""
    form = pattern.segment_form(ctx)
    if form is None or form.ids is None:
        return None
    ids = torch.where(ctx.real, form.ids, -1)
    return SegmentSource(ids, ctx.real, window_size(form.window, form.causal))
