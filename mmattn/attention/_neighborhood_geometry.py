"""Geometry of :class:`mmattn.NeighborhoodAttention`: reading ``Tokens.meta``, checking grids,
positions of packed rows.

Every check raises ValueError / TypeError naming the argument, expected vs actual.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from mmattn._masks_grid import grid_window, window_axes  # noqa: F401 (the layer's)
from mmattn.kernels._inputs import (  # noqa: F401 (the layer's checks are the kernel's)
    check_exportable,
    check_geometry,
    is_grid_list,
)
from mmattn.masks import neighborhood_mask

PROVIDER = "adapters.ImagePatcher sets it, VideoPatcher a (frames, rows, cols) one"


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


def call_window(
    module: Any, grid: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
    """The per-axis window of ``module`` (a NeighborhoodAttention) on a call's ``grid``."""
    return grid_window(getattr(module, "_axes", None), module.kernel_size, module.dilation,
                       module.causal, grid)


def dense_allowed(
    grid: Any, grid_start: Any, batch: int, length: int, kernel: tuple[int, ...],
    dilation: tuple[int, ...], causal: tuple[bool, ...], num_global_tokens: int,
    device: torch.device,
) -> Tensor:
    """(b, 1, l, l) bool "may attend" of a padded batch: the O(l²) pattern, for the dense
    fallback with an ``attn_mask``."""
    grids = grid if isinstance(grid, list) else [grid] * batch
    starts = grid_start if isinstance(grid_start, list) else [
        num_global_tokens if grid_start is None else grid_start
    ] * batch
    out = torch.zeros(batch, 1, length, length, dtype=torch.bool, device=device)
    for m, (shape, start) in enumerate(zip(grids, starts)):
        stop = start + math.prod(shape)
        live = length if grid_start is not None else stop
        out[m, 0, :live, :live] = True  # global rows and columns see everything live
        out[m, 0, start:stop, start:stop] = neighborhood_mask(
            shape, kernel, dilation=dilation, causal=causal, device=device
        )
    return out


def rows_position(position: Callable[..., Tensor], x: Tensor, lengths: list[int]) -> Tensor:
    """``position(x, 0)`` on each item of packed rows (t, h, e), positions from 0 per item."""
    if not lengths:
        return x
    longest = max(lengths)
    offsets = torch.tensor([0, *lengths], device=x.device).cumsum(0)[:-1]
    slot = torch.arange(longest, device=x.device)
    real = slot[None, :] < torch.tensor(lengths, device=x.device)[:, None]  # (b, l)
    index = torch.where(real, offsets[:, None] + slot[None, :], x.shape[0])
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[index]  # (b, l, h, e)
    moved = rearrange(position(rearrange(padded, "b l h e -> b h l e"), 0), "b h l e -> b l h e")
    return moved[real]
