"""Attention maps as pictures: one map with token labels, and every head side by side.

Axis key: ``h`` heads, ``i`` query length, ``j`` key length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch  # noqa: F401 - the Examples blocks run in this namespace
from matplotlib.figure import Figure
from torch import Tensor

from mmattn._checks import check_positive_int
from mmattn._helpers import ceil_div
from mmattn.viz._common import PathLike, _array, _draw_heatmap, _figure, _finish, _labels

__all__ = ["attention_heatmap", "head_grid"]


def attention_heatmap(
    weights: Tensor,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    *,
    title: str | None = None,
    path: PathLike | None = None,
    cmap: str = "viridis",
) -> Figure:
    """One attention map as a heatmap, queries down, keys across, with token labels.

    Args:
        weights: the map, e.g. one batch item of ``need_weights=True`` averaged weights.
        query_labels: one label per query row (any script; CJK renders, see the module doc).
        key_labels: one label per key column; defaults to ``query_labels`` when the map is
            square (self-attention).
        title: the figure title.
        path: also save the figure here.
        cmap: the matplotlib colour map.

    Shape:
        - weights: (i, j).

    Returns:
        The ``matplotlib.figure.Figure``.

    Raises:
        ValueError: ``weights`` is not 2-D, or a label list's length differs from the map's
            side (both numbers named).

    Examples:
        >>> fig = attention_heatmap(torch.eye(3), ["the", "cat", "sat"])
        >>> [t.get_text() for t in fig.axes[0].get_yticklabels()]
        ['the', 'cat', 'sat']
    """
    weights = _array(weights, "weights", (2,))
    i, j = weights.shape
    if key_labels is None and query_labels is not None and i == j:
        key_labels = query_labels
    ylabels = _labels(query_labels, i, "query_labels", "query rows")
    xlabels = _labels(key_labels, j, "key_labels", "key columns")
    fig = _figure(max(3.5, 0.3 * j + 2), max(3.0, 0.3 * i + 1.5))
    _draw_heatmap(fig.add_subplot(), weights, xlabels, ylabels, cmap, colorbar=True)
    return _finish(fig, title, path)


def head_grid(
    weights: Tensor,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    *,
    ncols: int = 4,
    title: str | None = None,
    path: PathLike | None = None,
    cmap: str = "viridis",
) -> Figure:
    """Every head's attention map side by side, one panel a head.

    Args:
        weights: per-head maps (``need_weights=True, average_attn_weights=False``, one batch
            item).
        query_labels: labels of the query rows (shown on the first column of panels).
        key_labels: labels of the key columns (shown on the last row of panels).
        ncols: panels per row.
        title: the figure title.
        path: also save the figure here.
        cmap: the matplotlib colour map.

    Shape:
        - weights: (h, i, j).

    Returns:
        The ``matplotlib.figure.Figure``.

    Raises:
        TypeError: ``ncols`` is not an int.
        ValueError: ``weights`` is not 3-D or holds no head, ``ncols < 1``, or a label list
            does not fit.

    Examples:
        >>> fig = head_grid(torch.rand(3, 4, 4).softmax(-1), ncols=2)
        >>> len([ax for ax in fig.axes if ax.get_images()])
        3
    """
    weights = _array(weights, "weights", (3,))
    check_positive_int("ncols", ncols)
    h, i, j = weights.shape
    if h == 0:
        raise ValueError(f"weights must hold at least one head, got shape {(h, i, j)}")
    if key_labels is None and query_labels is not None and i == j:
        key_labels = query_labels
    ylabels = _labels(query_labels, i, "query_labels", "query rows")
    xlabels = _labels(key_labels, j, "key_labels", "key columns")
    cols = min(ncols, h)
    rows = ceil_div(h, cols)
    side = max(2.0, 0.22 * max(i, j) + 1.0)
    fig = _figure(side * cols + 0.8, side * rows + 0.4)
    axes = fig.subplots(rows, cols, squeeze=False)
    top = (float(weights.max()) if weights.numel() else 0.0) or 1.0  # one scale for all
    image = None
    for head in range(rows * cols):
        ax = axes[head // cols][head % cols]
        if head >= h:
            ax.set_axis_off()
            continue
        first_col, last_row = head % cols == 0, head + cols >= h
        image = _draw_heatmap(ax, weights[head], xlabels if last_row else None,
                              ylabels if first_col else None, cmap, colorbar=False, vmax=top)
        ax.set_title(f"head {head}", fontsize=9)
        if not first_col:
            ax.set_ylabel("")
            ax.set_yticks([])
        if not last_row:
            ax.set_xlabel("")
            ax.set_xticks([])
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
    return _finish(fig, title, path)
