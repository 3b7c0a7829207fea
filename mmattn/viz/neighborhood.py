"""One patch's neighbourhood window and its weights, drawn over the image.

Axis key: ``r``/``c`` patch-grid rows and columns.
"""

from __future__ import annotations

import torch
from einops import rearrange
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from torch import Tensor

from mmattn.masks import neighborhood_mask
from mmattn.tokens import Tokens
from mmattn.viz._common import PathLike, _array, _figure, _finish
from mmattn.viz.modalities import _grid_of

__all__ = ["neighborhood_attention"]


def neighborhood_attention(
    weights: Tensor,
    image: Tensor,
    grid: tuple[int, int] | Tokens,
    query: int | tuple[int, int],
    *,
    kernel_size: int | tuple[int, int] | None = None,
    dilation: int | tuple[int, int] = 1,
    alpha: float = 0.6,
    title: str | None = None,
    path: PathLike | None = None,
    cmap: str = "viridis",
) -> Figure:
    """A query patch, the outline of its window, and its weights over the image.

    Left: the image with the query patch (red) and the patches of its window (white
    outline). Right: the query's attention weights on the patches, over the image. The
    window is :func:`mmattn.masks.neighborhood_mask`'s row of the query when
    ``kernel_size`` is given (so a border query shows its window shifted inward), else the
    patches with a non-zero weight.

    Args:
        weights: the query's row of the weights over the grid's patches (global tokens
            left out), row-major, or already (rows, cols).
        image: the image, channels first (float in [0, 1] or uint8; 1 or 3 channels) or (H, W).
        grid: the patch grid (rows, cols), or the ``Tokens`` from ``ImagePatcher``.
        query: the query patch, as its index in row-major order or as (row, col).
        kernel_size, dilation: of the layer, to outline the exact window.
        alpha: opacity of the weights.
        title: the figure title.
        path: also save the figure here.
        cmap: colour map of the weights.

    Shape:
        - weights: (rows * cols,) or (rows, cols); image: (C, H, W) or (H, W).

    Returns:
        The ``matplotlib.figure.Figure``.

    Raises:
        ValueError: weights that do not fit the grid, a query outside it, an image that is
            not 2-D / 3-D.

    Examples:
        >>> fig = neighborhood_attention(torch.rand(16), torch.rand(1, 8, 8), (4, 4), 5,
        ...                              kernel_size=3)
        >>> fig.axes[0].get_title()
        'patch (1, 1) and its window'
    """
    (rows, cols), meta = _grid_of(grid)
    weights = _array(weights, "weights", (1, 2))
    if weights.numel() != rows * cols:
        raise ValueError(
            f"weights of shape {tuple(weights.shape)} do not fit the patch grid "
            f"{(rows, cols)} ({rows * cols} patches)"
        )
    weights = rearrange(weights.reshape(-1), "(r c) -> r c", r=rows)
    index = query[0] * cols + query[1] if isinstance(query, tuple) else int(query)
    if not 0 <= index < rows * cols:
        raise ValueError(f"query must be a patch of the {(rows, cols)} grid, got {query!r}")
    if kernel_size is not None:
        window = neighborhood_mask((rows, cols), kernel_size, dilation=dilation)[index]
        window = rearrange(window, "(r c) -> r c", r=rows)
    else:
        window = weights > 0
    image = _array(image, "image", (2, 3)).float()
    if image.dim() == 3:
        image = rearrange(image, "c y x -> y x c")
        if image.shape[-1] == 1:
            image = image[..., 0]
    if image.max() > 1.0:
        image = image / 255.0
    height, width = image.shape[:2]
    patch = meta.get("patch_size")
    ph, pw = (height / rows, width / cols) if patch is None else (
        (patch, patch) if isinstance(patch, int) else patch
    )
    gray = "gray" if image.dim() == 2 else None
    fig = _figure(6.4, 3.2)
    left, right = fig.subplots(1, 2)
    for ax in (left, right):
        ax.imshow(image.clamp(0, 1).numpy(), cmap=gray)
        ax.set_xticks([])
        ax.set_yticks([])
    overlay = right.imshow(
        torch.where(window, weights, float("nan")).numpy(), cmap=cmap, alpha=alpha,
        extent=(-0.5, cols * pw - 0.5, rows * ph - 0.5, -0.5), interpolation="nearest",
    )
    fig.colorbar(overlay, ax=right, shrink=0.8)
    for r, c in torch.nonzero(window).tolist():
        left.add_patch(Rectangle((c * pw - 0.5, r * ph - 0.5), pw, ph, fill=False,
                                 edgecolor="white", linewidth=0.6))
    qr, qc = divmod(index, cols)
    for ax in (left, right):
        ax.add_patch(Rectangle((qc * pw - 0.5, qr * ph - 0.5), pw, ph, fill=False,
                               edgecolor="red", linewidth=1.5))
        ax.set_xlim(-0.5, width - 0.5)
        ax.set_ylim(height - 0.5, -0.5)
    left.set_title(f"patch {(qr, qc)} and its window", fontsize=9)
    right.set_title(f"its weights ({int(window.sum())} patches)", fontsize=9)
    return _finish(fig, title, path)
