"""The additive score terms of 2-D neighbourhood attention: ALiBi on the grid and NAT's
relative-position bias (:mod:`mmattn.kernels.neighborhood` adds them to each tile's mask).

Axis key: ``r`` flat rows, ``n`` tiles (or items), ``s`` query slots, ``t`` key slots,
``h`` heads, ``p`` the (row, col) of a grid cell.

For a query at grid cell (r, c) and a key at (r', c') of the same grid::

    ALiBi   −m_h · sqrt((r − r')² + (c − c')²)          Euclidean, in grid cells
    table   T[index((r − r') / d_r, (c − c') / d_c), h]    NAT's ``rpb`` in Swin's layout

with Swin's ``index(Δr, Δc) = (Δr + kh − 1)(2 kw − 1) + (Δc + kw − 1)`` of a (kh, kw) kernel
(:class:`mmattn.position.RelativePositionBias`): offsets are counted in units of the
dilation, as NATTEN indexes its ``rpb`` (a dilated window's keys are d cells apart, its
offsets −(k − 1) .. k − 1). A pair with a global token (class / register tokens, the other
modalities' tokens around a ``grid_start``) has no cell: both terms are 0 there.

The cell of every flat row depends only on the geometry and is cached (:func:`grid_coords`);
the terms are gathered per call (the table is a parameter).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import Tensor

from mmattn.kernels._neighborhood_plan import Item, Plan
from mmattn.kernels.modifiers import Modifiers


def softmax_modifiers(modifiers: Modifiers | None) -> Modifiers | None:
    """The modifiers a tile's attention call applies itself (sinks, softcap): ALiBi is the
    grid's, in the tiles' additive term, never the call's ``0 .. i - 1`` positions."""
    if not modifiers:
        return None
    kept = replace(modifiers, slopes=None, q_pos=None, k_pos=None, bias=None)
    return kept if kept else None


def grid_coords(total: int, items: tuple[Item, ...], device: torch.device) -> Tensor:
    """(total + 1, 2) long: the (row, col) cell of each flat row, (-1, -1) off the grid
    (global tokens, dead padding, the zero row at index ``total``); cached. While exporting
    call :func:`~._neighborhood_export.static_coords` instead."""
    return _grid_coords(total, items, str(device))


@functools.lru_cache(maxsize=32)
def _grid_coords(total: int, items: tuple[Item, ...], device: str) -> Tensor:
    coords = torch.full((total + 1, 2), -1, dtype=torch.long)
    for item in items:
        cells = torch.arange(item.rows * item.cols)
        first = item.offset + item.start
        coords[first:first + cells.numel(), 0] = cells // item.cols
        coords[first:first + cells.numel(), 1] = cells % item.cols
    return coords.to(torch.device(device))


def pair_terms(
    coords: Tensor,
    q_rows: Tensor,
    k_rows: Tensor,
    *,
    slopes: Tensor | None,
    table: Tensor | None,
    kernel: tuple[int, int],
    dilation: tuple[int, int],
    dtype: torch.dtype,
) -> Tensor | None:
    """The ALiBi and table terms between query rows and key rows; None without either.

    Pairs outside a window get a finite value (their offsets are clamped into the table):
    the caller's mask forbids them.

    Shape:
        - coords: (r + 1, 2); q_rows: (..., s); k_rows: (..., t); slopes: (h,);
          table: ((2 kh − 1)(2 kw − 1), h)
        - returns: (..., h, s, t)
    """
    if slopes is None and table is None:
        return None
    qc, kc = coords[q_rows], coords[k_rows]  # (..., s, 2), (..., t, 2)
    on = (qc[..., :, None, 0] >= 0) & (kc[..., None, :, 0] >= 0)  # (..., s, t)
    delta = qc[..., :, None, :] - kc[..., None, :, :]  # query minus key, (..., s, t, 2)
    term = None
    if slopes is not None:
        dist = torch.where(on, delta.to(dtype).square().sum(-1).sqrt(), 0.0)
        term = dist.unsqueeze(-3) * -slopes.to(dtype)[:, None, None]
    if table is not None:
        (kh, kw), (dh, dw) = kernel, dilation
        d_rows = torch.div(delta[..., 0], dh, rounding_mode="floor").clamp(1 - kh, kh - 1)
        d_cols = torch.div(delta[..., 1], dw, rounding_mode="floor").clamp(1 - kw, kw - 1)
        index = (d_rows + (kh - 1)) * (2 * kw - 1) + (d_cols + (kw - 1))
        bias = torch.where(on[..., None], table.to(dtype)[index], 0.0).movedim(-1, -3)
        term = bias if term is None else term + bias
    return term


def tile_terms(
    plan: Plan, coords: Tensor, *, slopes: Tensor | None, table: Tensor | None,
    kernel: tuple[int, int], dilation: tuple[int, int], dtype: torch.dtype,
) -> Tensor | None:
    """The terms of every tile of ``plan``: (n, h, s, t), or None."""
    n, slots, keys = plan.allowed.shape
    return pair_terms(
        coords, plan.q_index.view(n, slots), plan.k_index.view(n, keys), slopes=slopes,
        table=table, kernel=kernel, dilation=dilation, dtype=dtype,
    )
