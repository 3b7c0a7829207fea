"""Relative-position bias of neighbourhood attention: NAT's ``rpb`` in Swin's table layout.

Axis key: ``n`` tiles, ``s`` query slots of a tile, ``t`` key slots of a tile, ``h`` heads,
``b`` items, ``l`` tokens of an item, ``c`` grid cells of an item.

A grid query at (r, c) attending a grid key at (r', c') of its k × k window (kernel
(kh, kw), dilation (dh, dw)) gets ``table[index, h]`` added to its score, with Swin's index
of the offset in units of the dilation::

    index = ((r - r') / dh + kh - 1) · (2 kw - 1) + ((c - c') / dw + kw - 1)

The offsets of a window lie in ``[-(k - 1), k - 1]`` along each axis (windows are clamped
inward at the borders), so the table has ``(2 kh - 1)(2 kw - 1)`` rows, as
:class:`mmattn.position.RelativePositionBias` with ``window = kernel_size``. Pairs with a
global token, empty slots and pairs outside the window (masked anyway) read one extra zero
row after the table: no bias.

The index of a tile plan depends only on the geometry, like the plan
(:mod:`._neighborhood_plan`), and is cached beside it; it follows the plan's slot order
(each item's tiles from ``_grid_tiles``, the grid slab's key slots, then ``g_max`` global key
slots).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mmattn.kernels._neighborhood_plan import Item, _globals, _grid_tiles

__all__ = ["dense_bias", "grid_index", "table_rows", "tile_bias", "tile_index"]


def table_rows(kernel: tuple[int, int]) -> int:
    """Rows of a neighbourhood's bias table: one per relative offset of a window."""
    return (2 * kernel[0] - 1) * (2 * kernel[1] - 1)


def _offset_index(
    q_cells: Tensor, k_cells: Tensor, real: Tensor, cols: int, kernel: tuple[int, int],
    dilation: tuple[int, int],
) -> Tensor:
    """Table rows of (query cell, key cell) pairs (broadcast), the zero row where not real."""
    dr = torch.div(q_cells // cols - k_cells // cols, dilation[0], rounding_mode="floor")
    dc = torch.div(q_cells % cols - k_cells % cols, dilation[1], rounding_mode="floor")
    index = (dr + kernel[0] - 1) * (2 * kernel[1] - 1) + (dc + kernel[1] - 1)
    return torch.where(real, index, table_rows(kernel))


@functools.lru_cache(maxsize=64)
def grid_index(
    rows: int, cols: int, kernel: tuple[int, int], dilation: tuple[int, int]
) -> Tensor:
    """(c, c) table rows of every (query, key) pair of a grid, the zero row outside windows."""
    from mmattn._masks_grid import neighborhood_mask

    cells = torch.arange(rows * cols)
    allowed = neighborhood_mask((rows, cols), kernel, dilation=dilation)
    return _offset_index(cells[:, None], cells[None, :], allowed, cols, kernel, dilation)


def tile_index(
    items: tuple[Item, ...], kernel: tuple[int, int], dilation: tuple[int, int],
    tiles: tuple[int, int], device: torch.device,
) -> Tensor:
    """(n, s, t) table rows of every slot pair of the plan of ``items``; cached."""
    return _tile_index(items, kernel, dilation, tiles, str(device))


@functools.lru_cache(maxsize=32)
def _tile_index(
    items: tuple[Item, ...], kernel: tuple[int, int], dilation: tuple[int, int],
    tiles: tuple[int, int], device: str,
) -> Tensor:
    zero = table_rows(kernel)
    g_max = max((len(_globals(item)) for item in items), default=0)
    parts = []
    for item in items:
        q_cells, k_cells, ok = _grid_tiles(item.rows, item.cols, kernel, dilation, tiles)
        real = ok & (q_cells >= 0)[:, :, None] & (k_cells >= 0)[:, None, :]
        index = _offset_index(
            q_cells[:, :, None], k_cells[:, None, :], real, item.cols, kernel, dilation
        )
        parts.append(F.pad(index, (0, g_max), value=zero))  # global key slots: no bias
    if not parts:
        return torch.zeros(0, tiles[0] * tiles[1], 0, dtype=torch.long, device=device)
    return torch.cat(parts).to(device)


def tile_bias(table: Tensor, index: Tensor) -> Tensor:
    """(n, h, s, t) bias of the tiles from a (rows, h) table and :func:`tile_index`."""
    padded = F.pad(table, (0, 0, 0, 1))  # the zero row
    return rearrange(padded[index], "n s t h -> n h s t")


def dense_bias(
    table: Tensor, grid: Any, grid_start: Any, batch: int, length: int,
    kernel: tuple[int, int], dilation: tuple[int, int], num_global_tokens: int,
) -> Tensor:
    """(b, h, l, l) bias of a padded batch, O(l²): for the dense fallback with an attn_mask.

    ``grid`` is one (rows, cols) or a list of per-item grids; the grid of item m covers its
    tokens ``[start, start + rows · cols)`` (``start`` from ``grid_start``, default
    ``num_global_tokens``); every other pair gets no bias.
    """
    grids = grid if isinstance(grid, list) else [grid] * batch
    starts = grid_start if isinstance(grid_start, list) else [
        num_global_tokens if grid_start is None else grid_start
    ] * batch
    zero = table_rows(kernel)
    index = torch.full((batch, length, length), zero, dtype=torch.long)
    for m, ((rows, cols), start) in enumerate(zip(grids, starts)):
        stop = start + rows * cols
        index[m, start:stop, start:stop] = grid_index(rows, cols, tuple(kernel), tuple(dilation))
    padded = F.pad(table, (0, 0, 0, 1))
    return rearrange(padded[index.to(table.device)], "b i j h -> b h i j")
