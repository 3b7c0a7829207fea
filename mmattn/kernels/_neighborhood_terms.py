"""The additive score terms of neighbourhood attention: ALiBi on the grid and NAT's
relative-position bias (:mod:`mmattn.kernels.neighborhood` adds them to each tile's mask).

Axis key: ``r`` flat rows, ``n`` tiles (or items), ``s`` query slots, ``t`` key slots,
``h`` heads, ``a`` the axes of a grid cell ((t, row, col) of a video grid).

For a query at grid cell x and a key at x' of the same grid (1 to 3 axes), and on a 2-D grid
at (r, c) and (r', c')::

    ALiBi   −m_h · ‖x − x'‖₂                               Euclidean, in grid cells
    table   T[index((r − r') / d_r, (c − c') / d_c), h]    NAT's ``rpb`` in Swin's layout

with Swin's ``index(Δr, Δc) = (Δr + kh − 1)(2 kw − 1) + (Δc + kw − 1)`` of a (kh, kw) kernel
(:class:`mmattn.position.RelativePositionBias`): offsets are counted in units of the
dilation, as NATTEN indexes its ``rpb`` (a dilated window's keys are d cells apart, its
offsets −(k − 1) .. k − 1). A pair with a global token (class / register tokens, the other
modalities' tokens around a ``grid_start``) has no cell: both terms are 0 there. The table
is 2-D only (NAT's); ALiBi takes any grid.

The cell of every flat row depends only on the geometry and is cached with the plans, in
the cache bounded in bytes (:func:`plan_coords`, a constant under ``torch.compile`` and
``torch.export``, as the plan); the terms are gathered per call (the table is a parameter)
and reach the one tile runner (:func:`._neighborhood.run_tiles`) as call arguments.
"""

from __future__ import annotations

import math

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


def cell_coords(cells: Tensor, shape: tuple[int, ...]) -> Tensor:
    """(..., a) long: the coordinates along each axis of row-major ``cells`` of a grid."""
    strides = [math.prod(shape[a + 1:]) for a in range(len(shape))]
    return torch.stack([cells // stride % side for stride, side in zip(strides, shape)], -1)


def grid_coords(total: int, items: tuple[Item, ...], device: torch.device | str) -> Tensor:
    """(total + 1, a) long: the cell of each flat row along each of the grid's ``a`` axes,
    -1 off the grid (global tokens, dead padding, the zero row at index ``total``); cached in
    the plans' cache (bounded in bytes). Inside a trace call :func:`plan_coords` instead."""
    key = ("coords", total, items, str(device))
    coords = CACHE.get(key)
    if coords is None:
        axes = max((len(item.shape) for item in items), default=1)
        coords = torch.full((total + 1, axes), -1, dtype=torch.long)
        for item in items:
            first = item.offset + item.start
            coords[first:first + item.cells] = cell_coords(torch.arange(item.cells), item.shape)
        coords = coords.to(torch.device(device))
        coords = CACHE.put(key, coords, coords.nbytes)
    return coords


def plan_coords(plan: Plan) -> Tensor:
    """The cells of the rows ``plan`` was built for (:func:`grid_coords`); built outside any
    trace, so ``torch.compile`` and ``torch.export`` take them as a constant, as the plan."""
    return static_coords(plan.key.total, plan.key.items, plan.key.device)


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
    kernel: tuple[int, ...],
    dilation: tuple[int, ...],
    dtype: torch.dtype,
) -> Tensor | None:
    """The ALiBi and table terms between query rows and key rows; None without either.

    Pairs outside a window get a finite value (their offsets are clamped into the table):
    the caller's mask forbids them. The table needs a 2-D grid (the layers check it).

    Shape:
        - coords: (r + 1, a); q_rows: (..., s); k_rows: (..., t); slopes: (h,);
          table: ((2 kh − 1)(2 kw − 1), h)
        - returns: (..., h, s, t)
    """
    if slopes is None and table is None:
        return None
    qc, kc = coords[q_rows], coords[k_rows]  # (..., s, a), (..., t, a)
    on = (qc[..., :, None, 0] >= 0) & (kc[..., None, :, 0] >= 0)  # (..., s, t)
    delta = qc[..., :, None, :] - kc[..., None, :, :]  # query minus key, (..., s, t, a)
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
    plan: Plan, modifiers: Modifiers | None, table: Tensor | None, dtype: torch.dtype,
    span: tuple[int, int] | None = None,
) -> Tensor | None:
    """The ALiBi and table terms of every tile of ``plan`` (of tiles ``span = (n0, n1)``
    only, when given): (n, h, s, t), or None without either (the kernel and dilation are
    the plan's)."""
    slopes = None if modifiers is None else modifiers.slopes
    if slopes is None and table is None:
        return None
    n, slots, keys = plan.tile_shape
    n0, n1 = span or (0, n)
    return pair_terms(
        plan_coords(plan), plan.q_index[n0 * slots:n1 * slots].view(n1 - n0, slots),
        plan.k_index[n0 * keys:n1 * keys].view(n1 - n0, keys),
        slopes=slopes, table=table, kernel=plan.key.kernel, dilation=plan.key.dilation,
        dtype=dtype,
    )
