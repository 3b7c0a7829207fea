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

The cell of every flat row depends only on the geometry and is cached with the plans, in
the cache bounded in bytes (:func:`plan_coords`, a constant under ``torch.compile`` and
``torch.export``, as the plan); the terms are gathered per call (the table is a parameter)
and reach the one tile runner (:func:`._neighborhood.run_tiles`) as call arguments.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmattn._helpers import exporting
from mmattn.kernels._neighborhood_plan import CACHE, Item, Plan, _outside_trace
from mmattn.kernels.modifiers import Modifiers


def softmax_modifiers(modifiers: Modifiers | None) -> Modifiers | None:
    """The modifiers a tile's attention call applies itself (sinks, softcap): ALiBi is the
    grid's, in the tiles' additive term, never the call's ``0 .. i - 1`` positions."""
    if not modifiers:
        return None
    kept = modifiers.replace(slopes=None, q_pos=None, k_pos=None, bias=None)
    return kept if kept else None


def grid_coords(total: int, items: tuple[Item, ...], device: torch.device | str) -> Tensor:
    """(total + 1, 2) long: the (row, col) cell of each flat row, (-1, -1) off the grid
    (global tokens, dead padding, the zero row at index ``total``); cached in the plans'
    cache (bounded in bytes). Inside a trace call :func:`plan_coords` instead."""
    key = ("coords", total, items, str(device))
    coords = CACHE.get(key)
    if coords is None:
        coords = torch.full((total + 1, 2), -1, dtype=torch.long)
        for item in items:
            cells = torch.arange(item.rows * item.cols)
            first = item.offset + item.start
            coords[first:first + cells.numel(), 0] = cells // item.cols
            coords[first:first + cells.numel(), 1] = cells % item.cols
        coords = coords.to(torch.device(device))
        coords = CACHE.put(key, coords, coords.nbytes)
    return coords


def plan_coords(plan: Plan) -> Tensor:
    """The cells of the rows ``plan`` was built for (:func:`grid_coords`); built outside any
    trace, so ``torch.compile`` and ``torch.export`` take them as a constant, as the plan."""
    _, total, items, _, _, _, device = plan.key
    return static_coords(total, items, device)


@torch.compiler.assume_constant_result  # under torch.compile: a constant of the graph
def static_coords(total: int, items: tuple[Item, ...], device: str) -> Tensor:
    """:func:`grid_coords`, built outside any trace (a constant of a compiled or exported
    graph); ``device`` as a string."""
    if not exporting():
        return grid_coords(total, items, device)
    with _outside_trace():
        return grid_coords(total, items, device)


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
    plan: Plan, modifiers: Modifiers | None, table: Tensor | None, dtype: torch.dtype
) -> Tensor | None:
    """The ALiBi and table terms of every tile of ``plan``: (n, h, s, t), or None without
    either (the kernel and dilation are the plan's)."""
    slopes = None if modifiers is None else modifiers.slopes
    if slopes is None and table is None:
        return None
    _, _, _, kernel, dilation, _, _ = plan.key
    n, slots, keys = plan.tile_shape
    return pair_terms(
        plan_coords(plan), plan.q_index.view(n, slots), plan.k_index.view(n, keys),
        slopes=slopes, table=table, kernel=kernel, dilation=dilation, dtype=dtype,
    )
