"""Attention over a video's tubelets: what one token attends to, time step by time step.

Axis key: ``t`` time steps of the tubelet grid, ``r``/``c`` its rows and columns, ``f``
frames, ``y``/``x`` pixel rows and columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange
from matplotlib.figure import Figure
from torch import Tensor

from mmattn._checks import check_positive_int
from mmattn.tokens import Tokens
from mmattn.viz._common import PathLike, _array, _figure, _finish

__all__ = ["video_attention"]

Grid3 = tuple[int, int, int]


def _grid_of(grid: Grid3 | Tokens) -> tuple[Grid3, int | None]:
    """(steps, rows, cols) and the frames per step when the Tokens say (``tubelet``)."""
    if isinstance(grid, Tokens):
        if len(grid.meta.get("grid", ())) != 3:
            raise ValueError(
                "grid Tokens carry no 3-D meta['grid'] (made by VideoPatcher?), got meta "
                f"keys {sorted(grid.meta)}"
            )
        tubelet = grid.meta.get("tubelet")
        return tuple(grid.meta["grid"]), None if tubelet is None else int(tubelet[0])
    if not (isinstance(grid, Sequence) and len(grid) == 3):
        raise TypeError(f"grid must be (steps, rows, cols) or video Tokens, got {grid!r}")
    return tuple(check_positive_int(f"grid[{a}]", n) for a, n in enumerate(grid)), None


def video_attention(
    attention: Tensor,
    video: Tensor,
    grid: Grid3 | Tokens,
    *,
    query: int | None = None,
    allowed: Tensor | None = None,
    title: str | None = None,
    path: PathLike | None = None,
    cmap: str = "viridis",
) -> Figure:
    """One query's attention over a clip's tubelets: each time step's last frame, and under
    it the weight each of that step's tubelets receives.

    Typically a row of the weights of a layer over ``VideoPatcher`` tokens (the columns of the
    video's tokens, time-major as the patcher lays them out). Tubelets the query may not
    attend (``allowed`` False, e.g. a pattern's ``dense(tokens)`` row) are drawn grey, so a
    frame-causal or windowed pattern shows as the shape it is.

    Args:
        attention: the weight each tubelet receives, row-major (time, row, column), or
            already as a (steps, rows, cols) grid.
        video: the clip, (C, F, H, W) or (F, H, W) with 1 or 3 channels (uint8 or float).
        grid: the tubelet grid (steps, rows, cols), or the ``Tokens`` of ``VideoPatcher``
            (its ``meta["grid"]`` and ``meta["tubelet"]``).
        query: the query's tubelet index (row-major), marked with a red cross.
        allowed: bool, the same shape as ``attention``: where the query may attend.
        title: the figure title.
        path: also save the figure here.
        cmap: colour map of the weights.

    Shape:
        - attention, allowed: (steps * rows * cols,) or (steps, rows, cols).
        - video: (C, F, H, W) or (F, H, W), F frames (F / steps per step).

    Returns:
        The ``matplotlib.figure.Figure``: a row of frames over a row of weight grids.

    Raises:
        TypeError: ``grid`` is not three ints or video Tokens; ``query`` not an int.
        ValueError: ``attention`` or ``allowed`` does not fit the grid (shapes named);
            ``query`` outside the grid's tubelets;
            ``video`` of another rank, or with fewer frames than time steps.

    Examples:
        >>> fig = video_attention(torch.rand(2 * 3 * 3), torch.rand(4, 12, 12), (2, 3, 3))
        >>> [ax.get_title() for ax in fig.axes[2:4]]  # the weight rows
        ['step 0: 9 keys', 'step 1: 9 keys']
    """
    (steps, rows, cols), per_step = _grid_of(grid)
    cells = steps * rows * cols
    if query is not None and check_positive_int("query", query, minimum=0) >= cells:
        raise ValueError(
            f"query must be a tubelet index in [0, {cells}) of the grid {(steps, rows, cols)}, "
            f"got {query}"
        )
    attention = _array(attention, "attention", (1, 3))
    mask = torch.ones(cells, dtype=torch.bool) if allowed is None else _array(
        allowed, "allowed", (1, 3)).bool()
    for name, value in (("attention", attention), ("allowed", mask)):
        if value.numel() != cells:
            raise ValueError(
                f"{name} of shape {tuple(value.shape)} does not fit the tubelet grid "
                f"{(steps, rows, cols)} ({cells} tubelets)"
            )
    weights, mask = (rearrange(v.reshape(-1), "(t r c) -> t r c", t=steps, r=rows)
                     for v in (attention, mask))
    video = _array(video, "video", (3, 4))
    frames = video if video.dim() == 3 else rearrange(video, "c f y x -> f y x c")
    if frames.dim() == 4 and frames.shape[-1] == 1:
        frames = frames[..., 0]
    if frames.shape[0] < steps:
        raise ValueError(
            f"video must have at least one frame per time step ({steps}), got shape "
            f"{tuple(video.shape)}"
        )
    per_step = per_step or frames.shape[0] // steps
    if frames.max() > 1.0:
        frames = frames / 255.0
    shown = torch.where(mask, weights, torch.nan)
    top = float(weights[mask].max()) if mask.any() else 1.0
    import matplotlib

    colors = matplotlib.colormaps[cmap].copy()
    colors.set_bad("lightgray")  # not allowed
    fig = _figure(1.9 * steps + 0.6, 4.0)
    axes = fig.subplots(2, steps, squeeze=False)
    for t in range(steps):
        last = min(per_step * (t + 1), frames.shape[0]) - 1
        axes[0, t].imshow(frames[last].clamp(0, 1).numpy(),
                          cmap="gray" if frames.dim() == 3 else None)
        axes[0, t].set_title(f"frame {last}", fontsize=9)
        image = axes[1, t].imshow(shown[t].numpy(), cmap=colors, vmin=0.0, vmax=top,
                                  interpolation="nearest")
        axes[1, t].set_title(f"step {t}: {int(mask[t].sum())} keys", fontsize=9)
        if query is not None and query // (rows * cols) == t:
            axes[1, t].plot(query % cols, (query // cols) % rows, "r+", markersize=14)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(image, ax=axes[1, :].tolist(), shrink=0.8)
    return _finish(fig, title, path)
