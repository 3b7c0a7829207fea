"""The varlen engine: torch's ``varlen_attn`` (flash on the real lengths), and its arguments.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``l`` length, ``e`` head
width, ``t`` flat tokens (b·l), ``r`` runs (sequences varlen sees).

``varlen_attn`` takes packed rows (t, h, e) and ``cu_seqlens`` (r + 1,) int32: sequence m is
rows ``cu[m] .. cu[m + 1] − 1`` and attends only itself (``window_size`` = (left, right)
narrows it; (−1, 0) is causal). The argument builders here are pure tensor functions,
tested on the CPU against hand-computed values:

- :func:`offsets` — lengths → cu_seqlens (packed Tokens' jagged offsets already are);
- :func:`row_offsets` — a padded batch whose every row is one sequence (LocalAttention);
- :func:`runs` — per-token segment ids (B, L) → the runs of equal id in each row, the
  longest, the rows of no segment (dead: their outputs are set to 0), and whether every id
  is one contiguous run (else a segment pattern is not varlen's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn.kernels._scores import default_scale

__all__ = [
    "Runs", "offsets", "row_offsets", "runs", "segment_runs", "varlen_attend", "window_size",
]


def offsets(lengths: Tensor) -> Tensor:
    """(r,) lengths → (r + 1,) int32 cumulative offsets starting at 0."""
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths, 0)
    return out


def row_offsets(batch: int, length: int, device: torch.device | str = "cpu") -> Tensor:
    """(b + 1,) int32 offsets of a padded batch whose rows are the sequences: 0, l, 2 l, ..."""
    return torch.arange(0, (batch + 1) * length, max(length, 1), dtype=torch.int32,
                        device=device)[: batch + 1]


def window_size(window: int | None, causal: bool) -> tuple[int, int]:
    """varlen's (left, right): the whole run (−1) without ``window``; right 0 when causal."""
    left = -1 if window is None else int(window)
    return left, (0 if causal else left)


@dataclass(frozen=True)
class Runs:
    """A segment layout as varlen sees it.

    Attributes:
        cu_seqlens: (r + 1,) int32 offsets of the runs in the flat (b l) order.
        max_len: the longest run.
        dead: (b l,) bool rows of no segment (id < 0): their outputs are 0.
        contiguous: every segment id of a row is one run (the layout is exact).
    """

    cu_seqlens: Tensor
    max_len: int
    dead: Tensor
    contiguous: bool


def runs(ids: Tensor) -> Runs:
    """The runs of equal id in each row of ``ids`` (B, L) (negative ids: no segment).

    A run never crosses a row; a stretch of negative ids is one run too (its rows are dead).
    A few host reads (the run starts, the largest id, the contiguity check, the longest
    run: Python data for varlen), once per mask (segment_runs caches the result on it).

    Examples:
        >>> r = runs(torch.tensor([[0, 0, 1, 1, 1, -1], [4, 4, 4, 4, 2, 2]]))
        >>> r.cu_seqlens.tolist(), r.max_len, r.contiguous
        ([0, 2, 5, 6, 10, 12], 4, True)
    """
    batch, length = ids.shape
    flat = ids.reshape(-1)
    start = torch.ones_like(flat, dtype=torch.bool)
    if flat.numel():
        start[1:] = flat[1:] != flat[:-1]
        start[::length] = True  # every row starts a run
    first = start.nonzero().squeeze(1)
    bounds = torch.cat([first, first.new_tensor([flat.numel()])])
    lengths = bounds.diff()
    # contiguous: per row, each id >= 0 starts at most one run
    row = first // max(length, 1)
    key = row * (int(flat.max()) + 2 if flat.numel() else 1) + flat[first]
    live = flat[first] >= 0
    contiguous = bool(torch.unique(key[live]).numel() == int(live.sum()))
    return Runs(offsets(lengths).to(ids.device), int(lengths.max()) if lengths.numel() else 0,
                flat < 0, contiguous)


def varlen_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_len: int,
    *,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    groups: int = 1,
    dead: Tensor | None = None,
) -> Tensor:
    """Attention of a padded batch through ``varlen_attn`` over the given runs of its flat
    (b l) rows (unchecked: :func:`mmattn.kernels.engines.select` said it fits).

    Shape:
        - q: (b, h, l, e); k, v: (b, k, l, e); cu_seqlens (r + 1,) int32; dead (b l,)
        - returns: (b, h, l, e)
    """
    from torch.nn.attention.varlen import varlen_attn

    batch, heads, length, e = q.shape
    rows = [t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[-1])
            for t in (q, k, v)]
    out = packed_attend(*rows, cu_seqlens, cu_seqlens, max_len, max_len, window=window,
                        scale=scale, groups=groups, attend=varlen_attn)
    if dead is not None:
        out = torch.where(dead[:, None, None], 0.0, out)
    return out.view(batch, length, heads, -1).transpose(1, 2)


def packed_attend(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
                  max_k: int, *, window: tuple[int, int] = (-1, -1), scale: float | None = None,
                  groups: int = 1, attend=None) -> Tensor:
    """``varlen_attn`` on packed rows (t, h, e) (``enable_gqa`` only when groups > 1).

    Flash takes values as wide as the queries: values of another width e_v (attention_mass
    joins its group columns to them) run e columns a call, zero-padded, and are cropped.

    Shape:
        - q: (t_q, h, e); k: (t_k, k, e); v: (t_k, k, e_v); returns (t_q, h, e_v)
    """
    if attend is None:
        from torch.nn.attention.varlen import varlen_attn as attend
    scale = default_scale(q, scale)
    extra = {"enable_gqa": True} if groups > 1 else {}
    if window != (-1, -1):
        extra["window_size"] = window
    width, wide = q.shape[-1], v.shape[-1]
    parts = [v] if wide == width else F.pad(v, (0, -wide % width)).split(width, dim=-1)
    out = [attend(q, k, part, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                  scale=scale, **extra) for part in parts]
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)[..., :wide]


def segment_runs(mask: Any):
    """``(Runs, window)`` of a SparseMask compiled from a segment-wise pattern with
    contiguous runs (cached on the mask), else None. The compile leaves the pattern's facts
    in ``mask.segment_source`` (``patterns/_segments.py``: ids, real tokens, window)."""
    source = getattr(mask, "segment_source", None)
    if source is None:
        return None
    def build():
        found = runs(source.ids)
        return (found, source.window) if found.contiguous else None

    return mask.cached("segment-runs", build)
