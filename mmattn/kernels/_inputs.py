"""Cheap input checks of the public kernel entry points (see docs/decisions.md, "Kernels").

The layers check their input at their own boundary and call the kernels' unchecked bodies;
a direct call of a public kernel function goes through these instead. Shapes, dtypes and
devices cost O(1); ids and offsets are read once (O(E) or O(b)), as
:func:`mmattn._checks.check_range` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from mmattn import _checks as checks
from mmattn._masks_grid import check_window
from mmattn.kernels._neighborhood_plan import Item
from mmattn.kernels.modifiers import Modifiers

#: Who provides a grid, for the messages.
PROVIDER = "adapters.ImagePatcher / VideoPatcher set it"

#: The names of a grid's sides, by their number (for the messages).
_SIDE_NAMES = {1: ("length",), 2: ("rows", "cols"), 3: ("frames", "rows", "cols")}


def check_heads(q: object, k: object, v: object, layout: str) -> None:
    """Head-split ``q``, ``k``, ``v`` that fit together: ``layout`` is ``"(n, h, e)"`` (rows)
    or ``"(b, h, l, e)"`` (a padded batch); ``k`` and ``v`` share their rows and heads, the
    key heads divide the query heads, query and key share the head width.

    Raises:
        TypeError: not floating tensors, or of different dtypes.
        ValueError: another rank, rows, heads or width; another device.
    """
    rank = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t)
        checks.check_floating(name, t)
        checks.check_rank(name, t, (rank,), layout)
    checks.check_same_dtype("k", k, "q", q)
    checks.check_same_dtype("v", v, "q", q)
    checks.check_same_device("k", k, "q", q)
    checks.check_same_device("v", v, "q", q)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k and v must have the same rows and heads {layout}, got k {tuple(k.shape)} and "
            f"v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head width e, got q {tuple(q.shape)} and k "
            f"{tuple(k.shape)}"
        )
    if rank == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(
            f"q and k must have the same batch size, got q {tuple(q.shape)} and k "
            f"{tuple(k.shape)}"
        )
    heads, kv_heads = q.shape[1], k.shape[1]  # the head axis of both layouts
    if heads % max(kv_heads, 1) or (kv_heads == 0 and heads):  # 0 and 0: an empty axis
        raise ValueError(
            f"the key/value heads must divide the query heads (grouped-query attention), got "
            f"{heads} query heads and {kv_heads} key/value heads"
        )


def check_key_mask(key_mask: object, shape: tuple, like: Tensor, layout: str) -> None:
    """None, or a bool ("real key") / floating (added) mask of ``shape`` on ``like``'s device.

    Raises:
        TypeError: not a tensor, or an integer mask (0/1 added would not mask anything).
        ValueError: another shape or device.
    """
    if key_mask is None:
        return
    checks.check_tensor("key_mask", key_mask)
    checks.check_mask_dtype("key_mask", key_mask)
    checks.check_shape("key_mask", key_mask, shape, layout)
    checks.check_same_device("key_mask", key_mask, "q", like)


def check_modifiers(
    modifiers: object, table: object, heads: int, kernel: tuple[int, ...], like: Tensor
) -> None:
    """None or a :class:`~mmattn.kernels.modifiers.Modifiers` whose sinks / slopes are (h,);
    ``table`` None or a floating ((2 kh − 1)(2 kw − 1), h) tensor for a 2-D ``kernel``, both
    on ``like``'s device.

    Raises:
        TypeError: another type, an integer table.
        ValueError: another shape or device; a table for a grid that is not 2-D.
    """
    if modifiers is not None:
        if not isinstance(modifiers, Modifiers):
            raise TypeError(
                f"modifiers must be a mmattn.kernels.modifiers.Modifiers or None, got "
                f"{type(modifiers).__name__}"
            )
        for name in ("sinks", "slopes"):
            value = getattr(modifiers, name)
            if value is not None:
                checks.check_tensor(f"modifiers.{name}", value)
                checks.check_shape(f"modifiers.{name}", value, (heads,), "(h,)")
                checks.check_same_device(f"modifiers.{name}", value, "q", like)
    if table is not None:
        if len(kernel) != 2:
            raise ValueError(
                f"table (NAT's relative-position bias) needs a 2-D grid, got a kernel of "
                f"{len(kernel)} axes {kernel}; use alibi=True for 1-D and 3-D grids"
            )
        checks.check_tensor("table", table)
        if not table.is_floating_point():
            raise TypeError(f"table must be a floating tensor, got {table.dtype}")
        offsets = (2 * kernel[0] - 1) * (2 * kernel[1] - 1)
        checks.check_shape("table", table, (offsets, heads), "((2 kh - 1)(2 kw - 1), h)")
        checks.check_same_device("table", table, "q", like)


def check_options(dropout_p: object, scale: object, need_weights: object) -> None:
    """``dropout_p`` in [0, 1), ``scale`` None or a finite number, ``need_weights`` a bool."""
    checks.check_probability("dropout_p", dropout_p)
    if scale is not None:
        checks.check_number("scale", scale)
    checks.check_bool("need_weights", need_weights)


def is_grid_list(grid: object) -> bool:
    """True for a list of per-item grids (tuples of sides), False for one grid."""
    if isinstance(grid, Tensor):
        return grid.dim() == 2
    return (
        isinstance(grid, Sequence) and len(grid) > 0
        and all(isinstance(g, (Sequence, Tensor)) for g in grid)
    )


def check_geometry(
    grid: object,
    grid_start: object,
    lengths: Sequence[int],
    num_global_tokens: int,
    *,
    packed: bool,
) -> tuple[tuple[int, ...] | list[tuple[int, ...]], int | list[int] | None]:
    """Normalise ``grid`` / ``grid_start`` for items of ``lengths`` tokens; raise if they
    do not fit (a padded batch gives every item the padded length). A grid has 1, 2 or 3
    sides; per-item grids share one number of axes."""
    count = len(lengths)
    if grid is None:
        raise ValueError(
            f"grid must be given: (rows, cols) of the image patches ((frames, rows, cols) of "
            f"a video), or a list of one per item; Tokens.meta['grid'] holds it ({PROVIDER})"
        )
    if is_grid_list(grid):
        grids = [checks.check_grid(f"grid[{m}]", g, checks.GRID_AXES)
                 for m, g in enumerate(grid)]
        if len(grids) != count:
            raise ValueError(
                f"grid must hold one (rows, cols) per item: expected {count}, got {len(grids)}"
            )
        for m, g in enumerate(grids):
            if len(g) != len(grids[0]):
                raise ValueError(
                    f"grid must hold grids of one number of axes: grid[0] is {grids[0]}, "
                    f"grid[{m}] is {g}"
                )
        out: Any = grids
    else:
        out = checks.check_grid("grid", grid, checks.GRID_AXES)
        grids = [out] * count
    starts: list[int]
    if grid_start is None:
        starts = [num_global_tokens] * count
    else:
        if isinstance(grid_start, Tensor):
            grid_start = grid_start.tolist()
        if isinstance(grid_start, Sequence):
            if len(grid_start) != count:
                raise ValueError(
                    f"grid_start must hold one start per item: expected {count}, got "
                    f"{len(grid_start)}"
                )
            starts = [checks.check_positive_int("grid_start", s, minimum=0) for s in grid_start]
        else:
            starts = [checks.check_positive_int("grid_start", grid_start, minimum=0)] * count
        grid_start = starts if isinstance(grid_start, Sequence) else starts[0]
    exact = grid_start is None and (packed or not isinstance(out, list))
    for m, (shape, start, length) in enumerate(zip(grids, starts, lengths)):
        cells = math.prod(shape)
        need = start + cells
        if (exact and need != length) or need > length:
            item = f" of item {m}" if isinstance(out, list) else ""
            where = (
                f"{num_global_tokens} global tokens + " if grid_start is None
                else f"grid_start {start} + "
            )
            product = " * ".join(_SIDE_NAMES.get(len(shape), ()))
            raise ValueError(
                f"grid {shape}{item} has {product} = {cells} tokens, so the "
                f"sequence must have {where}{cells} = {need} tokens"
                f"{'' if exact else ' or more'}, got {length}"
            )
    return out, grid_start


def check_exportable(grid: object, grid_start: object, length: object) -> None:
    """Raise (at export time) for what NeighborhoodAttention cannot trace with a symbolic
    batch: the tile plan is built in Python from static sizes, so the length (fixed by the
    grid), the grid and grid_start must be plain ints, one for every item."""
    if not isinstance(length, int):
        raise NotImplementedError(
            "NeighborhoodAttention exports with a dynamic batch only: the length is fixed by "
            f"the grid (num_global_tokens + rows * cols), got a symbolic length {length}; "
            "mark only dim 0 dynamic"
        )
    if is_grid_list(grid) or isinstance(grid_start, (Sequence, Tensor)):
        raise NotImplementedError(
            "NeighborhoodAttention exports with a dynamic batch only for one grid (e.g. "
            "(rows, cols)) and one int grid_start for every item; per-item grids do not export"
        )


def check_items(
    total: object, items: object, kernel: object, dilation: object, tiles: object,
    causal: object = False,
) -> tuple[tuple, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
    """Items of a neighbourhood plan: each grid fits its rows, items in order inside
    ``[0, total)``, never overlapping, with one number of axes; per axis an odd kernel,
    dilation and tiles >= 1 and a causal flag (O(b))."""
    total = checks.check_positive_int("total", total, minimum=0)
    if not isinstance(items, (tuple, list)) or not all(isinstance(i, Item) for i in items):
        raise TypeError(
            "items must be a tuple of Item (from padded_items or packed_items), got "
            f"{type(items).__name__}"
        )
    shape = tuple(items[0].shape) if items else (1,) * (
        len(kernel) if isinstance(kernel, (tuple, list)) else 2)
    kernel, dilation, causal = check_window(shape, kernel, dilation, causal)
    tiles = checks.check_axes("tiles", tiles, len(shape), grid=shape)
    end = 0
    for m, item in enumerate(items):
        sides = checks.check_grid(f"items[{m}] grid", item.shape, (len(shape),))
        start = checks.check_positive_int(f"items[{m}].start", item.start, minimum=0)
        length = checks.check_positive_int(f"items[{m}].length", item.length, minimum=0)
        offset = checks.check_positive_int(f"items[{m}].offset", item.offset, minimum=0)
        if start + math.prod(sides) > length:
            raise ValueError(
                f"items[{m}] has a grid {sides} starting at {start}: it needs "
                f"{start + math.prod(sides)} rows, got length {length}"
            )
        if offset < end or offset + length > total:
            raise ValueError(
                f"items[{m}] covers rows [{offset}, {offset + length}), which must lie in "
                f"[{end}, total={total}) after the items before it"
            )
        end = offset + length
    return tuple(items), kernel, dilation, tiles, causal


def check_attention(q: object, k: object, v: object, mask: object) -> None:
    """The O(1) checks of :func:`mmattn.kernels.dense.attend` (and the kernels built on it):
    q, k, v of one rank (at least (h, l, e)) with one head width, k and v with the same
    heads and keys, key heads dividing query heads, a bool or floating mask.

    Batch dimensions and the mask's shape broadcast as in SDPA, so they are left to it.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t)
        checks.check_floating(name, t)
    checks.check_same_dtype("k", k, "q", q)
    checks.check_same_dtype("v", v, "q", q)
    if not 3 <= q.dim() == k.dim() == v.dim():
        raise ValueError(
            f"q, k and v must have one rank of at least 3 (..., h, l, e), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head width e, got q {tuple(q.shape)} and k "
            f"{tuple(k.shape)}"
        )
    if k.shape[-3:-1] != v.shape[-3:-1]:
        raise ValueError(
            f"k and v must have the same heads and keys (..., h, j, e), got k "
            f"{tuple(k.shape)} and v {tuple(v.shape)}"
        )
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if heads % max(kv_heads, 1) or (kv_heads == 0 and heads):  # 0 and 0: an empty axis
        raise ValueError(
            f"the key/value heads must divide the query heads (grouped-query attention), got "
            f"{heads} query heads and {kv_heads} key/value heads"
        )
    if mask is not None:
        checks.check_tensor("mask", mask)
        checks.check_mask_dtype("mask", mask)


def check_band(
    q: Tensor, k: Tensor, v: Tensor, window_size: object, key_mask: object,
    num_global_tokens: object, block_size: object,
) -> None:
    """The O(1) checks of :func:`mmattn.kernels.blocked.local_attend`: (b, h, l, e) tensors
    of one length, a window and global tokens >= 0, a block >= 1, a (b, l) key mask."""
    check_heads(q, k, v, "(b, h, l, e)")
    if k.shape[2] != q.shape[2]:
        raise ValueError(
            f"q and k must have the same length (a band of self-attention), got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}"
        )
    checks.check_positive_int("window_size", window_size, minimum=0)
    checks.check_positive_int("num_global_tokens", num_global_tokens, minimum=0)
    if block_size is not None:
        checks.check_positive_int("block_size", block_size)
    check_key_mask(key_mask, (q.shape[0], q.shape[2]), q, "(b, l)")
