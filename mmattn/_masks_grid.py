"""The dense reference mask of 2-D neighbourhood attention (re-exported by :mod:`mmattn.masks`).

Axis key: ``r``/``c`` grid rows and columns of the query, ``s``/``t`` of the key.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from mmattn._checks import (
    check_device,
    check_grid,
    check_kernel,
    check_pair,
    check_positive_int,
)

__all__ = ["neighborhood_mask"]


def axis_window(
    p: Tensor, n: Tensor | int, k: int, d: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Along an axis of ``n`` positions, position ``p``'s window (NATTEN): (sub, idx, start,
    stop). Position ``s`` is in it iff ``s % d == sub`` and ``start <= s // d < stop``.

    ``p`` belongs to the subgrid {q : q = p mod d} of size m (``idx`` = p // d its place
    there); its window is min(k, m) consecutive subgrid positions centred on p and shifted
    inward at the borders. The one statement of the rule: the dense reference below, the
    patterns' ``P.neighborhood`` and the flex engine's mask_mod all read it.

    Shape:
        - p: any integer tensor; n: an int or broadcastable to p; returns four like p
    """
    sub, idx = p % d, p // d
    size = (n - sub + d - 1) // d
    width = torch.clamp(size, max=k)
    start = torch.minimum(torch.clamp(idx - width // 2, min=0), size - width)
    return sub, idx, start, start + width


def _axis_allowed(n: int, k: int, d: int, device) -> Tensor:
    """(n, n) bool: along one axis of ``n`` positions, position p may attend position q."""
    sub, idx, start, stop = axis_window(torch.arange(n, device=device), n, k, d)
    same = sub[:, None] == sub[None, :]
    inside = (idx[None, :] >= start[:, None]) & (idx[None, :] < stop[:, None])
    return same & inside


def neighborhood_mask(
    grid: tuple[int, int],
    kernel_size: int | tuple[int, int],
    *,
    dilation: int | tuple[int, int] = 1,
    num_global_tokens: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """Dense "may attend" mask of 2-D neighbourhood attention (NATTEN's ``na2d``).

    Tokens are ``num_global_tokens`` global tokens followed by the ``rows * cols`` grid
    tokens in row-major order. Along an axis of n positions with dilation d, position p
    belongs to the subgrid {q : q = p mod d} of size m; its window is min(k, m) consecutive
    subgrid positions centred on p and shifted inward at the borders, so every query sees
    the same number of keys. A grid query attends the product of its row and column
    windows; global tokens attend every token and every token attends them.

    This is the O(L²) reference of :class:`mmattn.NeighborhoodAttention`: the module equals
    :class:`mmattn.MultiHeadAttention` with ``attn_mask=~neighborhood_mask(...)``.

    Args:
        grid: (rows, cols) of the patch grid.
        kernel_size: odd k, or (kh, kw).
        dilation: d >= 1, or (dh, dw).
        num_global_tokens: g >= 0 tokens before the grid.
        device: of the result.

    Shape:
        - returns: (L, L) bool with ``L = g + rows * cols``; True where attention is allowed.

    Raises:
        TypeError: an argument is not an int / a pair of ints.
        ValueError: an even kernel; a kernel, dilation or grid side < 1; g < 0.

    Examples:
        >>> neighborhood_mask((1, 4), (1, 3)).int().tolist()
        [[1, 1, 1, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 1]]
        >>> neighborhood_mask((2, 2), 3, num_global_tokens=1).shape
        torch.Size([5, 5])
    """
    rows, cols = check_grid("grid", grid)
    kh, kw = check_kernel("kernel_size", kernel_size)
    dh, dw = check_pair("dilation", dilation, what="(rows, cols)")
    g = check_positive_int("num_global_tokens", num_global_tokens, minimum=0)
    device = check_device("device", device)
    row_ok = _axis_allowed(rows, kh, dh, device)
    col_ok = _axis_allowed(cols, kw, dw, device)
    grid_ok = rearrange(
        row_ok[:, None, :, None] & col_ok[None, :, None, :], "r c s t -> (r c) (s t)"
    )
    length = g + rows * cols
    allowed = torch.ones(length, length, dtype=torch.bool, device=device)
    allowed[g:, g:] = grid_ok
    return allowed
