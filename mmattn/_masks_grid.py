"""The dense reference mask of N-D neighbourhood attention (re-exported by :mod:`mmattn.masks`).

Axis key: ``i``/``j`` query / key cells of the axes taken so far (row-major), ``p``/``q``
query / key positions along the next axis.

One rule per axis (:func:`axis_window`), N axes by product: a grid of 1, 2 or 3 axes is one
loop over the same function (NATTEN's ``na1d`` / ``na2d`` / ``na3d``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange
from torch import Tensor

from mmattn._checks import (
    GRID_AXES,
    GRID_SIDES,
    check_axes,
    check_device,
    check_grid,
    check_positive_int,
)

__all__ = ["neighborhood_mask", "axis_window", "check_window", "window_axes", "grid_window"]


def axis_window(
    p: Tensor, n: Tensor | int, k: int, d: int, causal: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Along an axis of ``n`` positions, position ``p``'s window (NATTEN): (sub, idx, start,
    stop). Position ``s`` is in it iff ``s % d == sub`` and ``start <= s // d < stop``.

    ``p`` belongs to the subgrid {q : q = p mod d} of size m (``idx`` = p // d its place
    there); its window is min(k, m) consecutive subgrid positions centred on p and shifted
    inward at the borders. On a ``causal`` axis it is the (at most) k subgrid positions
    ending at p. The one statement of the rule: the dense reference below, the kernel's tile
    plans, the patterns' ``P.neighborhood`` and the flex engine's mask_mod all read it.

    Shape:
        - p: any integer tensor; n: an int or broadcastable to p; returns four like p
    """
    sub, idx = p % d, p // d
    if causal:
        return sub, idx, torch.clamp(idx - (k - 1), min=0), idx + 1
    size = (n - sub + d - 1) // d
    width = torch.clamp(size, max=k)
    start = torch.minimum(torch.clamp(idx - width // 2, min=0), size - width)
    return sub, idx, start, start + width


def axis_allowed(n: int, k: int, d: int, causal: bool, device) -> Tensor:
    """(n, n) bool: along one axis of ``n`` positions, position p may attend position q."""
    sub, idx, start, stop = axis_window(torch.arange(n, device=device), n, k, d, causal)
    same = sub[:, None] == sub[None, :]
    inside = (idx[None, :] >= start[:, None]) & (idx[None, :] < stop[:, None])
    return same & inside


def check_window(
    grid: tuple[int, ...], kernel_size: object, dilation: object, causal: object
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
    """Per-axis (kernel, dilation, causal) for a checked ``grid``: a scalar applies to every
    axis, a tuple must have one entry per axis (ValueError naming the argument and the grid).
    """
    axes = len(grid)
    return (
        check_axes("kernel_size", kernel_size, axes, odd=True, grid=grid),
        check_axes("dilation", dilation, axes, grid=grid),
        check_axes("causal", causal, axes, flag=True, grid=grid),
    )


def window_axes(
    kernel_size: object, dilation: object, causal: object
) -> tuple[int | None, tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]]:
    """A layer's or pattern's window, checked before any grid is known: (the number of grid
    axes its tuples fix, or None when all three are one value for every axis; per-axis
    kernel, dilation and causal, as pairs when the axes are not fixed).

    Raises:
        TypeError: a kernel or dilation that is not an int or a tuple of ints, a causal
            that is not a bool or a tuple of bools.
        ValueError: tuples of different lengths (the message names them) or of other than 1
            to 3 entries, an even kernel, a kernel or dilation < 1.
    """
    values = {"kernel_size": kernel_size, "dilation": dilation, "causal": causal}
    given = {name: len(v) for name, v in values.items() if isinstance(v, (tuple, list))}
    if len(set(given.values())) > 1:
        raise ValueError(
            "kernel_size, dilation and causal must have one entry per grid axis, the same "
            f"number each: got {given}"
        )
    axes = next(iter(given.values()), None)
    if axes is not None and axes not in GRID_AXES:
        got = ", ".join(f"{name}={values[name]!r}" for name in given)
        raise ValueError(
            f"{' and '.join(given)} must have one entry per grid axis, 1 to 3 "
            f"({GRID_SIDES}), got {axes}: {got}"
        )
    return axes, check_window((1,) * (axes or 2), kernel_size, dilation, causal)


def describe_window(
    kernel: tuple[int, ...], dilation: tuple[int, ...], causal: tuple[bool, ...]
) -> str:
    """``kernel_size=(..), dilation=(..), causal=(..)``: a per-axis window in messages (the
    argument that fixed its axes may be any of the three)."""
    return f"kernel_size={tuple(kernel)}, dilation={tuple(dilation)}, causal={tuple(causal)}"


def grid_window(
    axes: int | None, kernel: tuple[int, ...], dilation: tuple[int, ...],
    causal: tuple[bool, ...], grid: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
    """The per-axis window (from :func:`window_axes`) on a ``grid``: its one value on every
    axis when ``axes`` is None, else its tuples, which must have one entry per side.

    Raises:
        ValueError: a grid of another number of axes than the window's (naming both).
    """
    if axes is None:  # one value for every axis: as many as the grid has
        return check_window(grid, kernel[0], dilation[0], causal[0])
    if len(grid) != len(kernel):
        raise ValueError(
            f"grid must have one side per axis of the window "
            f"({describe_window(kernel, dilation, causal)}): expected {len(kernel)} sides, "
            f"got grid {tuple(grid)}"
        )
    return tuple(kernel), tuple(dilation), tuple(causal)


def neighborhood_mask(
    grid: Sequence[int],
    kernel_size: int | tuple[int, ...],
    *,
    dilation: int | tuple[int, ...] = 1,
    causal: bool | tuple[bool, ...] = False,
    num_global_tokens: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """Dense "may attend" mask of N-D neighbourhood attention (NATTEN's ``na1d`` / ``na2d`` /
    ``na3d``).

    Tokens are ``num_global_tokens`` global tokens followed by the grid's cells in row-major
    order ((t, h, w) for a video grid). Along an axis of n positions with dilation d,
    position p belongs to the subgrid {q : q = p mod d} of size m; its window is min(k, m)
    consecutive subgrid positions centred on p and shifted inward at the borders, so every
    query sees the same number of keys; on a causal axis it is the (at most) k subgrid
    positions ending at p. A cell attends the product of its windows along every axis;
    global tokens attend every token and every token attends them.

    This is the O(L²) reference of :class:`mmattn.NeighborhoodAttention`: the module equals
    :class:`mmattn.MultiHeadAttention` with ``attn_mask=~neighborhood_mask(...)``.

    Args:
        grid: the sides of the grid: (length,), (rows, cols) or (frames, rows, cols).
        kernel_size: odd k for every axis, or one per axis.
        dilation: d >= 1 for every axis, or one per axis.
        causal: for every axis, or one bool per axis (NATTEN's ``is_causal``).
        num_global_tokens: g >= 0 tokens before the grid.
        device: of the result.

    Shape:
        - returns: (L, L) bool with ``L = g + prod(grid)``; True where attention is allowed.

    Raises:
        TypeError: a grid that is not 1 to 3 ints; a kernel or dilation that is not an int
            or a tuple of ints; ``causal`` not a bool or a tuple of bools.
        ValueError: an even kernel; a kernel, dilation or grid side < 1; a kernel, dilation
            or causal tuple with another number of entries than the grid has axes; g < 0.

    Examples:
        >>> neighborhood_mask((1, 4), (1, 3)).int().tolist()
        [[1, 1, 1, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 1]]
        >>> neighborhood_mask((4,), 3, causal=True).int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]
        >>> neighborhood_mask((2, 3, 3), (3, 3, 3), causal=(True, False, False)).shape
        torch.Size([18, 18])
    """
    grid = check_grid("grid", grid, GRID_AXES)
    kernel, dilation, causal = check_window(grid, kernel_size, dilation, causal)
    g = check_positive_int("num_global_tokens", num_global_tokens, minimum=0)
    device = check_device("device", device)
    grid_ok = torch.ones(1, 1, dtype=torch.bool, device=device)
    for n, k, d, c in zip(grid, kernel, dilation, causal):  # row-major: the product
        ok = axis_allowed(n, k, d, c, device)
        grid_ok = rearrange(grid_ok[:, None, :, None] & ok[None, :, None, :],
                            "i p j q -> (i p) (j q)")
    length = g + grid_ok.shape[0]
    allowed = torch.ones(length, length, dtype=torch.bool, device=device)
    allowed[g:, g:] = grid_ok
    return allowed

