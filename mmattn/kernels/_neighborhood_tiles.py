"""The tiles of one N-D neighbourhood grid and the tile shape's cost model (see
:mod:`mmattn.kernels._neighborhood_plan`).

Axis key: ``m`` tiles along one axis (of one dilation subgrid), ``n`` tiles of the grid,
``s`` query slots of a tile (the product of the tile's sides), ``t`` key slots of a tile
(the product of the slab's sides), ``a``/``b`` the tiles or slots of the axes so far and of
the next axis.

One rule per axis, N axes by product: :func:`axis_tiles` cuts one axis into tiles of
consecutive subgrid positions and finds each tile's slab of keys from the window function
of :func:`mmattn._masks_grid.axis_window` (the rule the dense mask states); :func:`grid_tiles`
takes the product over the axes, in row-major order, whatever their number.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
from einops import rearrange
from torch import Tensor

from mmattn._helpers import ceil_div
from mmattn._masks_grid import axis_window

#: One axis's tiles of one subgrid: query positions (m, t), key positions (m, S), allowed
#: (m, t, S); positions on the full axis, -1 for an empty slot.
AxisTiles = tuple[Tensor, Tensor, Tensor]


def axis_tiles(n: int, k: int, d: int, t: int, causal: bool = False) -> list[AxisTiles]:
    """The tiles of one axis of ``n`` positions, per dilation subgrid, with ``S = t + k - 1``
    key slots each.

    A tile holds ``t`` consecutive positions of a subgrid of size m (fewer slots are real
    when ``m < t``); the last tile of the subgrid is shifted inward to end on the border (it
    overlaps its neighbour). Windows move monotonically along the subgrid, so the tile's
    keys lie between its first query's window start and its last query's window stop: at
    most ``t + k - 1`` positions (centred windows are clamped inward, causal ones end at
    their query), so the slab never leaves the axis. A slab centred on the border is shifted
    inward; key slots past what the tile needs are empty.
    """
    slab = t + k - 1
    out = []
    for a in range(min(d, n)):
        size = (n - a + d - 1) // d
        tile = min(t, size)
        starts = list(range(0, size - tile + 1, tile))
        if starts[-1] + tile < size:
            starts.append(size - tile)  # the last tile ends on the border
        q_sub = torch.tensor(starts)[:, None] + torch.arange(t)  # (m, t) subgrid indices
        q_real = torch.arange(t) < tile
        _, _, lo, hi = axis_window(a + q_sub.clamp(max=size - 1) * d, n, k, d, causal)
        first, last = lo[:, 0], hi[:, tile - 1]
        if not causal:  # the slab of a centred window ends inside the axis
            first = first.clamp(max=size - min(size, tile + min(k, size) - 1))
        k_sub = first[:, None] + torch.arange(slab)  # (m, S)
        k_real = k_sub < last[:, None]
        ok = (k_sub[:, None, :] >= lo[:, :, None]) & (k_sub[:, None, :] < hi[:, :, None])
        ok = torch.where(q_real[None, :, None], ok & k_real[:, None, :], True)
        q_pos = torch.where(q_real, a + q_sub * d, -1)
        k_pos = torch.where(k_real, a + k_sub * d, -1)
        out.append((q_pos, k_pos, ok))
    return out


def _join(cells: Tensor, pos: Tensor, side: int) -> Tensor:
    """Row-major cells of the axes so far (a, s) and one more axis (b, t) -> (a b, s t);
    -1 where either is an empty slot."""
    joined = cells[:, None, :, None] * side + pos[None, :, None, :]
    empty = (cells[:, None, :, None] < 0) | (pos[None, :, None, :] < 0)
    return rearrange(torch.where(empty, -1, joined), "a b s t -> (a b) (s t)")


def grid_tiles(
    shape: tuple[int, ...], kernel: tuple[int, ...], dilation: tuple[int, ...],
    causal: tuple[bool, ...], tiles: tuple[int, ...],
) -> tuple[Tensor, Tensor, Tensor]:
    """The tiles of one grid: query cells (n, s), key cells (n, t), allowed (n, s, t); cells
    are row-major grid indices, -1 for an empty slot. The product of :func:`axis_tiles`
    over the axes (tiles never mix dilation subgrids)."""
    pieces = [(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
               torch.ones(1, 1, 1, dtype=torch.bool))]
    for side, k, d, c, t in zip(shape, kernel, dilation, causal, tiles):
        axis = axis_tiles(side, k, d, t, c)
        pieces = [
            (_join(q, qa, side), _join(kc, ka, side),
             rearrange(ok[:, None, :, None, :, None] & oka[None, :, None, :, None, :],
                       "a b s u t v -> (a b) (s u) (t v)"))
            for q, kc, ok in pieces for qa, ka, oka in axis
        ]
    q_cells, k_cells, oks = zip(*pieces)
    return torch.cat(q_cells), torch.cat(k_cells), torch.cat(oks)


#: Candidate tile sides. 1 and 2 serve the short axes of a video grid (frames with a
#: kernel of 3); a 2-D grid's cost model still picks sides of 4 to 16 (TILE_OVERHEAD).
TILE_CHOICES = (1, 2, 4, 6, 8, 12, 16)

#: The fixed cost of one tile, in scores (see :func:`choose_tiles`).
TILE_OVERHEAD = 6144


@functools.lru_cache(maxsize=64)
def choose_tiles(
    items: tuple, kernel: tuple[int, ...], dilation: tuple[int, ...]
) -> tuple[int, ...]:
    """Tile shape, one side per axis, from a cost model: per tile ``s · t`` scores plus a
    fixed cost.

    A tile of ``prod(t_a)`` queries scores ``prod(t_a + k_a - 1)`` grid keys for each query:
    small tiles waste fewer scores, large ones make fewer, bigger matmuls and gather fewer
    halo keys. The fixed cost of a tile is worth :data:`TILE_OVERHEAD` scores (measured on
    the CPU, docs/performance.md). Sides are capped at a subgrid's size.
    """
    shapes = [tuple(ceil_div(n, d) for n, d in zip(item.shape, dilation)) for item in items]
    axes = len(kernel)
    longest = [max((s[a] for s in shapes), default=1) for a in range(axes)]
    sub = math.prod(dilation)
    best, best_cost = (1,) * axes, math.inf
    for sides in itertools.product(TILE_CHOICES, repeat=axes):
        tile = tuple(min(t, n) for t, n in zip(sides, longest))
        keys = math.prod(t + k - 1 for t, k in zip(tile, kernel))
        cost = 0.0
        for shape in shapes:
            count = sub * math.prod(ceil_div(n, min(t, n)) for t, n in zip(tile, shape))
            cost += count * (math.prod(tile) * keys + TILE_OVERHEAD)
        if cost < best_cost:
            best, best_cost = tile, cost
    return best
