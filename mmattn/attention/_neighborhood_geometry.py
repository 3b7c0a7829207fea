"""Geometry of :class:`mmattn.NeighborhoodAttention`: reading ``Tokens.meta`` and checking grids.

Every check raises ValueError / TypeError naming the argument, expected vs actual.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from mmattn import _checks as checks
from mmattn.masks import neighborhood_mask

PROVIDER = "adapters.ImagePatcher sets it"


def grid_from_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """``{"grid": ...}`` (and ``"grid_start"`` inside fused Tokens) from ``Tokens.meta``.

    ``meta["grid"]`` (one grid) or ``meta["grids"]`` (one per item) of image Tokens; for
    Tokens fused by :class:`~mmattn.MultiModalEncoder` (``meta["spans"]``), the one modality
    whose own meta holds a grid: its span's start becomes ``grid_start``, so every token of
    the other modalities is global.
    """
    if "grid" in meta:
        return {"grid": tuple(meta["grid"])}
    if "grids" in meta:
        return {"grid": [tuple(g) for g in meta["grids"]]}
    spans = meta.get("spans")
    if isinstance(spans, Mapping):
        images = [
            name for name in spans
            if isinstance(meta.get(name), Mapping) and {"grid", "grids"} & set(meta[name])
        ]
        if len(images) > 1:
            raise ValueError(
                f"NeighborhoodAttention takes one image grid per sequence, but the fused Tokens "
                f"hold grids for the modalities {images}; fuse one image modality"
            )
        if images:
            out = grid_from_meta(meta[images[0]])
            start = spans[images[0]][0]
            out["grid_start"] = start.tolist() if isinstance(start, Tensor) else int(start)
            return out
    raise ValueError(
        "NeighborhoodAttention needs the image grid: Tokens.meta has no 'grid' (or 'grids') "
        f"key ({PROVIDER}); pass grid=(rows, cols) to forward"
    )


def is_grid_list(grid: object) -> bool:
    """True for a list of per-item (rows, cols) pairs, False for one pair."""
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
) -> tuple[tuple[int, int] | list[tuple[int, int]], int | list[int] | None]:
    """Normalise ``grid`` / ``grid_start`` for items of ``lengths`` tokens; raise if they
    do not fit (a padded batch gives every item the padded length)."""
    count = len(lengths)
    if grid is None:
        raise ValueError(
            f"grid must be given: (rows, cols) of the image patches, or a list of one per "
            f"item; Tokens.meta['grid'] holds it ({PROVIDER})"
        )
    if is_grid_list(grid):
        grids = [checks.check_grid(f"grid[{m}]", g) for m, g in enumerate(grid)]
        if len(grids) != count:
            raise ValueError(
                f"grid must hold one (rows, cols) per item: expected {count}, got {len(grids)}"
            )
        out: Any = grids
    else:
        out = checks.check_grid("grid", grid)
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
    for m, ((rows, cols), start, length) in enumerate(zip(grids, starts, lengths)):
        need = start + rows * cols
        if (exact and need != length) or need > length:
            item = f" of item {m}" if isinstance(out, list) else ""
            where = (
                f"{num_global_tokens} global tokens + " if grid_start is None
                else f"grid_start {start} + "
            )
            raise ValueError(
                f"grid {(rows, cols)}{item} has rows * cols = {rows * cols} tokens, so the "
                f"sequence must have {where}{rows * cols} = {need} tokens"
                f"{'' if exact else ' or more'}, got {length}"
            )
    return out, grid_start


def dense_allowed(
    grid: Any, grid_start: Any, batch: int, length: int, kernel: tuple[int, int],
    dilation: tuple[int, int], num_global_tokens: int, device: torch.device,
) -> Tensor:
    """(b, 1, l, l) bool "may attend" of a padded batch: the O(l²) pattern, for the dense
    fallback with an ``attn_mask``."""
    grids = grid if isinstance(grid, list) else [grid] * batch
    starts = grid_start if isinstance(grid_start, list) else [
        num_global_tokens if grid_start is None else grid_start
    ] * batch
    out = torch.zeros(batch, 1, length, length, dtype=torch.bool, device=device)
    for m, ((rows, cols), start) in enumerate(zip(grids, starts)):
        stop = start + rows * cols
        live = length if grid_start is not None else stop
        out[m, 0, :live, :live] = True  # global rows and columns see everything live
        out[m, 0, start:stop, start:stop] = neighborhood_mask(
            (rows, cols), kernel, dilation=dilation, device=device
        )
    return out


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
            "NeighborhoodAttention exports with a dynamic batch only for one grid (rows, cols) "
            "and one int grid_start for every item; per-item grids do not export"
        )
