"""Attention drawn on the data: over image patches, under audio frames, on graph nodes.

Axis key: ``r``/``c`` patch-grid rows and columns, ``l`` frames, ``m`` mel bins, ``n`` graph
nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange
from matplotlib.figure import Figure
from torch import Tensor

from mmattn._checks import check_integer_dtype, check_number, check_pair, check_positive_int
from mmattn.tokens import Tokens
from mmattn.viz._common import PathLike, _array, _figure, _finish, _labels, label_font

__all__ = ["audio_attention", "graph_attention", "image_attention"]


def _grid_of(grid: tuple[int, int] | Tokens) -> tuple[tuple[int, int], dict]:
    if isinstance(grid, Tokens):
        if "grid" not in grid.meta:
            raise ValueError("grid Tokens carry no meta['grid'] (made by ImagePatcher?)")
        return tuple(grid.meta["grid"]), grid.meta
    if not (isinstance(grid, Sequence) and len(grid) == 2):
        raise TypeError(f"grid must be (rows, cols) or image Tokens, got {grid!r}")
    return check_pair("grid", grid, minimum=0, what="(rows, cols)"), {}


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
        TypeError: ``grid`` is not a pair of ints or image Tokens.
        ValueError: the map's size does not fit the grid (both shapes named), a negative
            grid, or ``image`` is not 2-D / 3-D with 1, 3 or 4 channels.

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
        if image.shape[0] not in (1, 3, 4):
            raise ValueError(
                f"image must have 1, 3 or 4 channels (channels first), got shape "
                f"{tuple(image.shape)}"
            )
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
        TypeError: ``frame_rate`` is not a number.
        ValueError: the map's length differs from the spectrogram's frame count (both shapes
            named); ``frame_rate`` is not a finite number > 0.

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
    if frame_rate is not None:
        frame_rate = check_number("frame_rate", frame_rate, positive=True)
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
        TypeError: ``num_nodes`` or ``query`` is not an int, ``edge_index`` not integer.
        ValueError: the map's length differs from the node count, the graph has no node,
            ``edge_index`` is not (2, E) or names a node outside the graph, or ``pos`` does
            not fit.

    Examples:
        >>> ring = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
        >>> fig = graph_attention(torch.tensor([0.1, 0.2, 0.3, 0.4]), ring, query=0)
        >>> len(fig.axes)
        2
    """
    attention = _array(attention, "attention", (1,))
    n = attention.shape[0] if num_nodes is None else check_positive_int("num_nodes", num_nodes)
    if n == 0:
        raise ValueError("attention must hold at least one node: a graph of 0 nodes has "
                         "nothing to draw, got shape (0,)")
    if attention.shape[0] != n:
        raise ValueError(
            f"attention of shape {tuple(attention.shape)} does not fit the graph's "
            f"{n} nodes (expected shape ({n},))"
        )
    edge_index = torch.as_tensor(edge_index).detach().cpu()
    check_integer_dtype("edge_index", edge_index, "node ids")
    edge_index = edge_index.long()
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must be (2, E), got shape {tuple(edge_index.shape)}")
    if edge_index.numel() and (edge_index.min() < 0 or edge_index.max() >= n):
        raise ValueError(
            f"edge_index names node {int(edge_index.max())} but the graph has {n} nodes"
        )
    if query is not None and not 0 <= check_positive_int("query", query, minimum=0) < n:
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
