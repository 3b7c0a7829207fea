"""Grids and per-token ids placed on a batch of Tokens (read by :mod:`._context`).

Axis key: ``b`` batch, ``l`` sequence length, ``a`` axes of a grid.

Grids come from ``meta[name]["grid"]`` / ``["grids"]`` placed at ``meta["spans"][name]``
(fused), else ``meta["grid"]`` / ``meta["grids"]`` from position 0: a grid has 1, 2 or 3
sides ((length,), (rows, cols), (frames, rows, cols)); ``"grids"`` is a list of them or a
(b, a) integer tensor. Grids of fewer axes than the longest one placed are given leading
sides of 1 (an image (r, c) is the video (1, r, c)), so every token has one coordinate per
axis. Per-token ids (``P.same``, ``P.causal(by=...)``) come from ``meta[key]`` (b, l), or
from each span's own ``meta[name][key]`` placed at the span, -1 elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmattn import _checks as checks


@dataclass(frozen=True)
class Grid:
    """Per-token grid coordinates: grid id (-1 outside every grid); per axis the token's
    position and its grid's side (0 and 1 outside, and on the leading axes a grid lacks);
    ``axes``: the number of sides of each grid the tokens use; ``whole``: each item's one
    grid covers all its L tokens (no grid id to compare). Tensors (b, l) int64."""

    gid: Tensor
    coords: tuple[Tensor, ...]
    sides: tuple[Tensor, ...]
    axes: tuple[int, ...]
    whole: bool = False

    @property
    def row(self) -> Tensor:
        """A 2-D grid's row of each token (the second to last axis)."""
        return self.coords[-2]

    @property
    def col(self) -> Tensor:
        """A 2-D grid's column of each token (the last axis)."""
        return self.coords[-1]


def read_grid(ctx: Any, need: str, names: tuple[str, ...] | None = None) -> Grid:
    """The grids of ``ctx``'s tokens (of the spans in ``names`` only, when given: the
    others' tokens are outside every grid); ValueError naming ``"grid"`` when the tokens
    have none at all."""
    placed = []  # (name, start per item (B,), stop per item (B,), dims per item (B, a))
    for name, (start, stop) in (ctx.spans() or {}).items():
        sub = ctx.meta.get(name)
        dims = grid_dims(sub, f"meta[{name!r}]", ctx.batch) if isinstance(
            sub, Mapping) else None
        if dims is not None:
            placed.append((name, start, stop, dims))
    if not placed:
        dims = grid_dims(ctx.meta, "meta", ctx.batch)
        if dims is None:
            raise ValueError(
                f"{need} needs a grid: meta['grid'] / meta['grids'] (image tokens, e.g. "
                "ImagePatcher; (frames, rows, cols) of VideoPatcher) or meta[name]['grid'] of "
                "a span (MultiModalEncoder); the tokens' meta has keys "
                f"{sorted(map(str, ctx.meta))}"
            )
        zero = torch.zeros(ctx.batch, dtype=torch.long, device=ctx.device)
        placed.append((None, zero, zero + ctx.length, dims))
    axes = max(dims.shape[1] for _, _, _, dims in placed)
    shape = (ctx.batch, ctx.length)
    gid = torch.full(shape, -1, dtype=torch.long, device=ctx.device)
    coords = [torch.zeros_like(gid) for _ in range(axes)]
    sides = [torch.ones_like(gid) for _ in range(axes)]
    used = []
    for index, (name, start, stop, dims) in enumerate(placed):
        dims = dims.to(ctx.device)
        size = dims.prod(dim=1)
        if ctx.length and bool((size > stop - start).any()):  # L = 0: nothing placed
            raise ValueError(
                f"grid {dims.tolist()} has more cells than the {(stop - start).tolist()} "
                "tokens it is placed on; meta 'grid' must describe the tokens"
            )
        if names is not None and name not in names:
            continue
        used.append(int(dims.shape[1]))
        local = ctx.positions - start[:, None]  # (B, L)
        inside = (local >= 0) & (local < size[:, None])
        gid = torch.where(inside, index, gid)
        lead = axes - dims.shape[1]  # leading sides of 1
        for a in range(dims.shape[1]):
            stride = dims[:, a + 1:].prod(dim=1, keepdim=True)
            side = dims[:, a:a + 1]
            coords[lead + a] = torch.where(inside, local // stride % side, coords[lead + a])
            sides[lead + a] = torch.where(inside, side, sides[lead + a])
    cells = placed[0][3].prod(dim=1)  # (CPU ints: reading them costs no device sync)
    whole = len(used) == len(placed) == 1 and placed[0][0] is None and bool(
        (cells == ctx.length).all())
    return Grid(gid, tuple(coords), tuple(sides), tuple(used), whole)


def grid_dims(meta: Mapping[str, Any], where: str, batch: int) -> Tensor | None:
    """(B, a) int64 grid of each item from ``meta['grid']`` / ``meta['grids']``, or None."""
    if "grid" in meta:
        sides = checks.check_grid(f"{where}['grid']", meta["grid"], checks.GRID_AXES)
        return torch.tensor(sides, dtype=torch.long).expand(batch, len(sides))  # also B = 0
    if "grids" in meta:
        grids = meta["grids"]
        if isinstance(grids, Tensor):  # (B, a), as NeighborhoodAttention takes it
            return _grid_table(f"{where}['grids']", grids, batch)
        if not isinstance(grids, Sequence) or len(grids) != batch:
            raise ValueError(
                f"{where}['grids'] must hold one (rows, cols) per item ({batch}), got {grids!r}"
            )
        sides = [checks.check_grid(f"{where}['grids'][{b}]", g, checks.GRID_AXES)
                 for b, g in enumerate(grids)]
        if len({len(s) for s in sides}) > 1:
            raise ValueError(f"{where}['grids'] must hold grids of one number of axes, got "
                             f"{sides}")
        return torch.tensor(sides, dtype=torch.long).reshape(batch, len(sides[0]) if sides else 2)
    return None


def _grid_table(name: str, grids: Tensor, batch: int) -> Tensor:
    """A (B, a) integer tensor of per-item grids (a = 1, 2 or 3), each side >= 1, as int64
    on the CPU."""
    checks.check_integer_dtype(name, grids, "(rows, cols) of each item")
    if grids.dim() != 2 or grids.shape[0] != batch or grids.shape[1] not in checks.GRID_AXES:
        raise ValueError(
            f"{name} must have shape ({batch}, 2) (({batch}, 3) for (frames, rows, cols)): one "
            f"grid per item, got {tuple(grids.shape)}"
        )
    if grids.numel() and not torch.compiler.is_compiling() and bool((grids < 1).any()):
        raise ValueError(f"{name} must hold sides >= 1, got {grids.tolist()}")
    return grids.to("cpu", torch.long)


def placed_ids(ctx: Any, key: str, check: Callable[[str, object, int], Tensor]) -> Tensor | None:
    """(B, L) int64 ids of ``meta[name][key]`` of every span that has them, placed at the
    span, -1 elsewhere; None when no span has ``key``. ``check(name, value, width)`` checks
    a part's (B, width) ids."""
    out = None
    for name, (start, stop) in (ctx.spans() or {}).items():
        sub = ctx.meta.get(name)
        if not isinstance(sub, Mapping) or key not in sub:
            continue
        width = int(sub[key].shape[-1]) if isinstance(sub[key], Tensor) else 0
        ids = check(f"meta[{name!r}][{key!r}]", sub[key], width)
        local = ctx.positions - start[:, None]  # (B, L)
        inside = (local >= 0) & (local < (stop - start)[:, None]) & (local < width)
        picked = ids.gather(1, local.clamp(0, max(width - 1, 0))) if width else local
        out = torch.full_like(local, -1) if out is None else out
        out = torch.where(inside, picked, out)
    return out
