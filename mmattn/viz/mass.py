"""How much each modality attends to each other: one small heatmap per attention call.

Axis key: ``c`` attention calls (layers), ``h`` heads, ``m`` query groups, ``n`` key groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure
from torch import Tensor

from mmattn._checks import check_positive_int
from mmattn.viz._common import PathLike, _array, _figure, _finish, _labels, label_font

__all__ = ["modality_mass"]


def modality_mass(
    mass: Any,
    modalities: Sequence[str] | None = None,
    modules: Sequence[str] | None = None,
    *,
    head: int | None = None,
    ncols: int = 4,
    annotate: bool = True,
    title: str | None = None,
    path: PathLike | None = None,
    cmap: str = "viridis",
) -> Figure:
    """The modality-to-modality attention mass of every call, one heatmap per call (layer).

    Panel ``c`` shows ``table[c]``: row m (query modality) and column n (key modality) is
    the mean share of its attention that a query of modality m gives to keys of modality n.
    Every panel uses one colour scale from 0 to 1 (a perceptually uniform map, ``viridis``
    by default), so the layers compare at a glance; each cell is written out too. A NaN cell
    (no query of that modality in the call) is left blank. Labels in Chinese, Japanese or
    Korean use an installed CJK font (see :func:`mmattn.viz.label_font`).

    Args:
        mass: an :class:`~mmattn.debug.AttentionMass` (its ``table``, ``modalities`` and
            ``modules`` are used), or the table itself.
        modalities: the group names (required with a bare table; overrides the result's).
        modules: panel titles, one per call (default: the result's module names, or
            "call c").
        head: draw this head only; None averages the heads (ignoring NaN).
        ncols: panels per row.
        annotate: write each cell's value in it.
        title: the figure title.
        path: also save the figure here.
        cmap: the matplotlib colour map.

    Shape:
        - table: (calls, heads, M, M) or (calls, M, M) (heads already merged).

    Returns:
        The ``matplotlib.figure.Figure``: one panel (with an image) per call, then the
        colour bar.

    Raises:
        TypeError: ``ncols`` or ``head`` is not an int.
        ValueError: the table is not 3-D / 4-D or not square in its last two axes, holds no
            call, ``head`` is out of range, or a label list does not fit.

    Examples:
        >>> table = torch.tensor([[[0.9, 0.1], [0.3, 0.7]], [[0.6, 0.4], [0.5, 0.5]]])
        >>> fig = modality_mass(table, ["text", "image"])
        >>> [ax.get_title() for ax in fig.axes if ax.get_images()]
        ['call 0', 'call 1']
        >>> [t.get_text() for t in fig.axes[0].get_xticklabels()]
        ['text', 'image']
    """
    table = mass.table if hasattr(mass, "table") else mass
    if modalities is None:
        modalities = getattr(mass, "modalities", None)
    if modules is None:
        modules = getattr(mass, "modules", None)
    table = _array(table, "table", (3, 4))
    check_positive_int("ncols", ncols)
    if table.dim() == 4:
        if head is None:
            table = table.nanmean(dim=1)
        else:
            if isinstance(head, bool) or not isinstance(head, int):
                raise TypeError(f"head must be an int or None, got {type(head).__name__}")
            if not 0 <= head < table.shape[1]:
                raise ValueError(f"head must be in [0, {table.shape[1]}), got {head}")
            table = table[:, head]
    calls, rows, cols = table.shape
    if rows != cols:
        raise ValueError(f"table must be square in its last two axes (M, M), got {rows}x{cols}")
    if calls == 0:
        raise ValueError("table holds no attention call")
    if modalities is None:
        raise ValueError("modalities must be given with a bare table (the M group names)")
    names = _labels(modalities, rows, "modalities", "groups")
    titles = _labels(modules, calls, "modules", "calls") if modules is not None else None
    titles = [t or "(model)" for t in titles] if titles else [f"call {c}" for c in range(calls)]
    return _draw(table, names, titles, ncols, annotate, cmap, title, path)


def _draw(table: Tensor, names: list[str], titles: list[str], ncols: int, annotate: bool,
          cmap: str, title: str | None, path: PathLike | None) -> Figure:
    calls, m, _ = table.shape
    cols = min(ncols, calls)
    rows = math.ceil(calls / cols)
    longest = max(map(len, names), default=1)
    side = max(2.4, 0.55 * m + 0.09 * longest + 1.0)
    fig = _figure(side * cols + 1.0, side * rows + 0.5)
    axes = fig.subplots(rows, cols, squeeze=False)
    family = label_font()
    image, panels = None, []
    for c in range(rows * cols):
        ax = axes[c // cols][c % cols]
        if c >= calls:
            ax.remove()
            continue
        panels.append(ax)
        values = table[c]
        image = ax.imshow(values.numpy(), cmap=cmap, vmin=0.0, vmax=1.0, aspect="equal",
                          interpolation="nearest")
        ax.set_xticks(range(m))
        ax.set_yticks(range(m))
        slanted = longest > 5
        ax.set_xticklabels(names, fontfamily=family, fontsize=8, rotation=45 if slanted else 0,
                           ha="right" if slanted else "center")
        ax.set_yticklabels(names, fontfamily=family, fontsize=8)
        ax.set_title(titles[c], fontsize=9, fontfamily=family)
        if c % cols == 0:
            ax.set_ylabel("query", fontsize=8)
        if c + cols >= calls:
            ax.set_xlabel("key", fontsize=8)
        if annotate:
            for i in range(m):
                for j in range(m):
                    value = float(values[i, j])
                    if math.isnan(value):
                        continue
                    colour = "black" if value > 0.6 else "white"  # dark cells, light text
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8,
                            color=colour)
    bar = fig.colorbar(image, ax=panels, shrink=0.8)
    bar.set_label("share of the query's attention", fontsize=8)
    return _finish(fig, title, path)
