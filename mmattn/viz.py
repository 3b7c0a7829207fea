"""Pictures of attention: heatmaps with token labels, maps over image patches, spectrogram
frames and graph nodes, and per-head grids.

Axis key: ``h`` heads, ``i`` query length, ``j`` key length, ``r``/``c`` patch-grid rows and
columns, ``m`` mel bins, ``n`` graph nodes.

Needs matplotlib (the ``examples`` extra: ``pip install "mmattn[examples]"``); it is not
imported by ``import mmattn`` — use ``import mmattn.viz``. Every function draws on a fresh
``matplotlib.figure.Figure`` (no pyplot, so no window and no global state), returns it, and
also writes it to ``path`` when one is given (the format follows the suffix, e.g. ``.png``).

Labels in Chinese, Japanese or Korean are drawn with a CJK-capable font when one is installed
(a system font such as Noto Sans CJK or WenQuanYi, or the WenQuanYi Micro Hei font that the
``examples`` extra installs); a character that no installed font can draw is written as its
``\\uXXXX`` escape rather than as an empty box.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

try:
    from matplotlib import font_manager, ft2font
    from matplotlib.figure import Figure
except ImportError as error:  # pragma: no cover - exercised by hiding matplotlib in a test
    raise ImportError(
        'mmattn.viz needs matplotlib: pip install "mmattn[examples]"'
    ) from error

from mmattn.tokens import Tokens

__all__ = [
    "attention_heatmap",
    "audio_attention",
    "graph_attention",
    "head_grid",
    "image_attention",
    "label_font",
]

#: Families tried, in order, for labels the default font cannot draw.
CJK_FAMILIES = (
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Noto Sans SC",
    "Source Han Sans SC",
    "WenQuanYi Micro Hei",
    "WenQuanYi Zen Hei",
    "Droid Sans Fallback",
    "SimHei",
    "Microsoft YaHei",
    "PingFang SC",
    "Hiragino Sans GB",
    "AR PL UMing CN",
)
#: Python packages known to ship a CJK font file (registered with matplotlib when present).
FONT_PACKAGES = ("paperang_p2_fonts_cjk",)

PathLike = str | Path


# --- fonts ---------------------------------------------------------------------------------


def _register_package_fonts() -> None:
    for package in FONT_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            for file in sorted(Path(root).rglob("*")):
                if file.suffix.lower() in (".ttf", ".ttc", ".otf"):
                    font_manager.fontManager.addfont(str(file))


@cache
def _charmap(family: str) -> frozenset[int]:
    path = font_manager.findfont(family, fallback_to_default=False)
    return frozenset(ft2font.FT2Font(path).get_charmap())


@lru_cache(maxsize=1)
def _cjk_family() -> str | None:
    _register_package_fonts()
    installed = {f.name for f in font_manager.fontManager.ttflist}
    for family in CJK_FAMILIES:
        if family in installed:
            return family
    return None


def label_font() -> list[str]:
    """The font families labels are drawn with: the default sans-serif, then a CJK one.

    Returns:
        ``["DejaVu Sans"]`` plus the first installed CJK-capable family, if any;
        matplotlib falls back glyph by glyph along this list.

    Examples:
        >>> label_font()[0]
        'DejaVu Sans'
    """
    cjk = _cjk_family()
    return ["DejaVu Sans"] if cjk is None else ["DejaVu Sans", cjk]


def _drawable(text: str) -> str:
    """``text`` with every character no label font can draw replaced by its ``\\uXXXX``."""
    covered = frozenset().union(*(_charmap(f) for f in label_font()))
    return "".join(
        ch if ch.isspace() or ord(ch) in covered else ch.encode("unicode_escape").decode()
        for ch in text
    )


# --- helpers -------------------------------------------------------------------------------


def _array(value: Any, name: str, ndim: tuple[int, ...]) -> Tensor:
    if not isinstance(value, Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"{name} must be a tensor or array, got {type(value).__name__}") \
                from error
    if value.dim() not in ndim:
        dims = " or ".join(f"{d}-D" for d in ndim)
        raise ValueError(f"{name} must be {dims}, got shape {tuple(value.shape)}")
    return value.detach().float().cpu()


def _labels(labels: Sequence[str] | None, n: int, name: str, what: str) -> list[str] | None:
    if labels is None:
        return None
    labels = [_drawable(str(label)) for label in labels]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} labels but the map has {n} {what}")
    return labels


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return fig


def _finish(fig: Figure, title: str | None, path: PathLike | None, dpi: int = 110) -> Figure:
    if title:
        fig.suptitle(_drawable(title), fontsize=10, fontfamily=label_font())
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    return fig


def _draw_heatmap(ax, weights: Tensor, xlabels, ylabels, cmap: str, colorbar: bool,
                  vmax: float | None = None):
    image = ax.imshow(weights.numpy(), cmap=cmap, aspect="auto", interpolation="nearest",
                      vmin=0.0 if vmax is not None else None, vmax=vmax)
    family = label_font()
    for labels, set_ticks, set_labels in (
        (xlabels, ax.set_xticks, ax.set_xticklabels),
        (ylabels, ax.set_yticks, ax.set_yticklabels),
    ):
        if labels is None:
            continue
        set_ticks(range(len(labels)))
        rotation = 90 if labels is xlabels and max(map(len, labels), default=0) > 2 else 0
        set_labels(labels, fontfamily=family, fontsize=8, rotation=rotation)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if colorbar:
        ax.figure.colorbar(image, ax=ax, shrink=0.8)
    return image


# --- the pictures --------------------------------------------------------------------------


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
        >>> fig = attention_heatmap(torch.eye(3), ["我", "爱", "你"])
        >>> [t.get_text() for t in fig.axes[0].get_yticklabels()]
        ['我', '爱', '你']
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
        ValueError: ``weights`` is not 3-D, ``ncols < 1``, or a label list does not fit.

    Examples:
        >>> fig = head_grid(torch.rand(3, 4, 4).softmax(-1), ncols=2)
        >>> len([ax for ax in fig.axes if ax.get_images()])
        3
    """
    weights = _array(weights, "weights", (3,))
    if ncols < 1:
        raise ValueError(f"ncols must be >= 1, got {ncols}")
    h, i, j = weights.shape
    if key_labels is None and query_labels is not None and i == j:
        key_labels = query_labels
    ylabels = _labels(query_labels, i, "query_labels", "query rows")
    xlabels = _labels(key_labels, j, "key_labels", "key columns")
    cols = min(ncols, h)
    rows = -(-h // cols)
    side = max(2.0, 0.22 * max(i, j) + 1.0)
    fig = _figure(side * cols + 0.8, side * rows + 0.4)
    axes = fig.subplots(rows, cols, squeeze=False)
    top = float(weights.max()) or 1.0  # one colour scale for every head
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


def _grid_of(grid: tuple[int, int] | Tokens) -> tuple[tuple[int, int], dict]:
    if isinstance(grid, Tokens):
        if "grid" not in grid.meta:
            raise ValueError("grid Tokens carry no meta['grid'] (made by ImagePatcher?)")
        return tuple(grid.meta["grid"]), grid.meta
    if not (isinstance(grid, Sequence) and len(grid) == 2):
        raise TypeError(f"grid must be (rows, cols) or image Tokens, got {grid!r}")
    return (int(grid[0]), int(grid[1])), {}


def image_attention(
    attention: Tensor,
    image: Tensor,
    grid: tuple[int, int] | Tokens,
    *,
    alpha: float = 0.55,
    title: str | None = None,
    path: PathLike | None = None,
    cmap: str = "inferno",
) -> Figure:
    """One query's attention over image patches, drawn on the image.

    Typically the class token's row of the weights, without its own column:
    ``weights[b, 0, 1:]`` when the class token comes first.

    Args:
        attention: the attention each patch receives, patch order row-major (as
            ``ImagePatcher`` makes them), or already as a (rows, cols) grid.
        image: the image, channels first (``uint8`` or float; 1 or 3 channels) or (H, W).
        grid: the patch grid (rows, cols), or the ``Tokens`` from ``ImagePatcher`` (its
            ``meta["grid"]``, ``patch_size`` and ``stride`` place the patches exactly).
        alpha: opacity of the attention overlay.
        title: the figure title.
        path: also save the figure here.
        cmap: colour map of the overlay.

    Shape:
        - attention: (rows * cols,) or (rows, cols).
        - image: (C, H, W) or (H, W).

    Returns:
        The ``matplotlib.figure.Figure`` (the image, and the image with the overlay).

    Raises:
        ValueError: the map's size does not fit the grid (both shapes named), or ``image``
            is not 2-D / 3-D.

    Examples:
        >>> fig = image_attention(torch.arange(4.0), torch.rand(3, 8, 8), (2, 2))
        >>> fig.axes[1].get_title()
        'attention over 2x2 patches'
    """
    (rows, cols), meta = _grid_of(grid)
    attention = _array(attention, "attention", (1, 2))
    if attention.numel() != rows * cols or (attention.dim() == 2
                                            and tuple(attention.shape) != (rows, cols)):
        raise ValueError(
            f"attention of shape {tuple(attention.shape)} does not fit the patch grid "
            f"{(rows, cols)} ({rows * cols} patches)"
        )
    attention = rearrange(attention.reshape(-1), "(r c) -> r c", r=rows, c=cols)
    image = _array(image, "image", (2, 3))
    if image.dim() == 3:
        image = rearrange(image, "c y x -> y x c")
        if image.shape[-1] == 1:
            image = image[..., 0]
    if image.max() > 1.0:
        image = image / 255.0
    height, width = image.shape[:2]
    patch = meta.get("patch_size")
    if patch is not None:  # the patches cover the (possibly padded) image exactly
        ph, pw = (patch, patch) if isinstance(patch, int) else patch
        stride = meta.get("stride") or patch
        sh, sw = (stride, stride) if isinstance(stride, int) else stride
        extent = (-0.5, (cols - 1) * sw + pw - 0.5, (rows - 1) * sh + ph - 0.5, -0.5)
    else:
        extent = (-0.5, width - 0.5, height - 0.5, -0.5)
    gray = "gray" if image.dim() == 2 else None
    fig = _figure(6.0, 3.2)
    left, right = fig.subplots(1, 2)
    left.imshow(image.clamp(0, 1).numpy(), cmap=gray)
    left.set_title("image", fontsize=9)
    right.imshow(image.clamp(0, 1).numpy(), cmap=gray)
    overlay = right.imshow(attention.numpy(), cmap=cmap, alpha=alpha, extent=extent,
                           interpolation="nearest")
    right.set_xlim(-0.5, width - 0.5)
    right.set_ylim(height - 0.5, -0.5)
    right.set_title(f"attention over {rows}x{cols} patches", fontsize=9)
    fig.colorbar(overlay, ax=right, shrink=0.8)
    for ax in (left, right):
        ax.set_xticks([])
        ax.set_yticks([])
    return _finish(fig, title, path)


def audio_attention(
    attention: Tensor,
    spectrogram: Tensor,
    *,
    frame_rate: float | None = None,
    title: str | None = None,
    path: PathLike | None = None,
    cmap: str = "magma",
) -> Figure:
    """One query's attention over audio frames, drawn under the clip's spectrogram.

    Args:
        attention: the attention each frame receives (e.g. a pooling query's weights).
        spectrogram: the clip's frames, e.g. ``AudioFrameEmbedder.features(wave)[b]`` (log-mel,
            one row a frame).
        frame_rate: frames per second (``tokens.meta["frame_rate"]``) to label the time axis
            in seconds; None labels it in frames.
        title: the figure title.
        path: also save the figure here.
        cmap: colour map of the spectrogram.

    Shape:
        - attention: (l,).
        - spectrogram: (l, m).

    Returns:
        The ``matplotlib.figure.Figure`` (spectrogram on top, attention below, shared time).

    Raises:
        ValueError: the map's length differs from the spectrogram's frame count (both shapes
            named).

    Examples:
        >>> fig = audio_attention(torch.rand(20).softmax(0), torch.randn(20, 16))
        >>> len(fig.axes)
        2
    """
    attention = _array(attention, "attention", (1,))
    spectrogram = _array(spectrogram, "spectrogram", (2,))
    if attention.shape[0] != spectrogram.shape[0]:
        raise ValueError(
            f"attention of shape {tuple(attention.shape)} does not fit the spectrogram of "
            f"shape {tuple(spectrogram.shape)} ({spectrogram.shape[0]} frames)"
        )
    frames = spectrogram.shape[0]
    scale = 1.0 if frame_rate is None else 1.0 / frame_rate
    fig = _figure(6.5, 3.8)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1.4))
    top.imshow(rearrange(spectrogram, "l m -> m l").numpy(), origin="lower", aspect="auto",
               cmap=cmap, extent=(-0.5 * scale, (frames - 0.5) * scale, -0.5,
                                  spectrogram.shape[1] - 0.5))
    top.set_ylabel("mel bin")
    times = (torch.arange(frames) * scale).numpy()
    bottom.fill_between(times, attention.numpy(), step="mid", alpha=0.6, color="tab:orange")
    bottom.plot(times, attention.numpy(), drawstyle="steps-mid", color="tab:red", linewidth=1)
    bottom.set_ylabel("attention")
    bottom.set_xlabel("frame" if frame_rate is None else "time (s)")
    bottom.set_ylim(bottom=0)
    return _finish(fig, title, path)


def _layout(num_nodes: int, edges: list[tuple[int, int]], seed: int) -> Tensor:
    try:
        import networkx as nx
    except ImportError:
        angle = torch.arange(num_nodes) * (2 * torch.pi / max(1, num_nodes))
        return torch.stack([angle.cos(), angle.sin()], dim=-1)
    graph = nx.Graph()
    graph.add_nodes_from(range(num_nodes))
    graph.add_edges_from(edges)
    pos = nx.spring_layout(graph, seed=seed)
    return torch.tensor([list(pos[n]) for n in range(num_nodes)], dtype=torch.float32)


def graph_attention(
    attention: Tensor,
    edge_index: Tensor,
    *,
    num_nodes: int | None = None,
    query: int | None = None,
    node_labels: Sequence[str] | None = None,
    pos: Tensor | None = None,
    seed: int = 0,
    title: str | None = None,
    path: PathLike | None = None,
    cmap: str = "viridis",
) -> Figure:
    """Node attention on a drawing of the graph: colour and size show what each node gets.

    Args:
        attention: the attention each node receives (one query's row, or a pooling query's
            weights), in the graph's node order.
        edge_index: the graph's edges, as in torch_geometric.
        num_nodes: the node count (default: the map's length); must equal it.
        query: a node to ring in red (the query whose row is shown).
        node_labels: a label per node.
        pos: node positions; default a spring layout (networkx, seeded) or a circle.
        seed: the layout seed.
        title: the figure title.
        path: also save the figure here.
        cmap: colour map of the nodes.

    Shape:
        - attention: (n,).
        - edge_index: (2, E), values in [0, n).
        - pos: (n, 2).

    Returns:
        The ``matplotlib.figure.Figure``.

    Raises:
        ValueError: the map's length differs from the node count, ``edge_index`` is not
            (2, E) or names a node outside the graph, or ``pos`` does not fit.

    Examples:
        >>> ring = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
        >>> fig = graph_attention(torch.tensor([0.1, 0.2, 0.3, 0.4]), ring, query=0)
        >>> len(fig.axes)
        2
    """
    attention = _array(attention, "attention", (1,))
    n = attention.shape[0] if num_nodes is None else int(num_nodes)
    if attention.shape[0] != n:
        raise ValueError(
            f"attention of shape {tuple(attention.shape)} does not fit the graph's "
            f"{n} nodes (expected shape ({n},))"
        )
    edge_index = torch.as_tensor(edge_index).detach().cpu().long()
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must be (2, E), got shape {tuple(edge_index.shape)}")
    if edge_index.numel() and (edge_index.min() < 0 or edge_index.max() >= n):
        raise ValueError(
            f"edge_index names node {int(edge_index.max())} but the graph has {n} nodes"
        )
    if query is not None and not 0 <= query < n:
        raise ValueError(f"query must be a node in [0, {n}), got {query}")
    labels = _labels(node_labels, n, "node_labels", "nodes")
    edges = [tuple(e) for e in edge_index.t().tolist()]
    if pos is None:
        pos = _layout(n, edges, seed)
    pos = _array(pos, "pos", (2,))
    if tuple(pos.shape) != (n, 2):
        raise ValueError(f"pos must be ({n}, 2), got {tuple(pos.shape)}")
    fig = _figure(5.0, 4.2)
    ax = fig.add_subplot()
    for a, b in edges:
        ax.plot(*pos[[a, b]].t().numpy(), color="0.7", linewidth=0.8, zorder=1)
    top = float(attention.max()) or 1.0
    sizes = (60 + 440 * attention / top).numpy()
    dots = ax.scatter(pos[:, 0].numpy(), pos[:, 1].numpy(), c=attention.numpy(), s=sizes,
                      cmap=cmap, edgecolors="black", linewidths=0.5, zorder=2)
    if query is not None:
        ax.scatter(pos[query, 0], pos[query, 1], s=sizes[query] + 250, facecolors="none",
                   edgecolors="red", linewidths=2, zorder=3)
    if labels is not None:
        for k, label in enumerate(labels):
            ax.annotate(label, pos[k].numpy(), fontsize=7, ha="center", va="center",
                        fontfamily=label_font(), zorder=4)
    fig.colorbar(dots, ax=ax, shrink=0.8, label="attention")
    ax.set_axis_off()
    return _finish(fig, title, path)
