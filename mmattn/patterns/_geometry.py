"""Primitives on geometry: ``neighborhood`` (image grids) and ``edges`` (graphs).

Axis key: ``b`` batch, ``q``/``k`` query/key positions, ``n``/``m`` query/key tiles, ``s``
tile width.

``neighborhood`` bounds a tile by the grid-row and grid-column ranges of its tokens (a key
row farther than (k - 1) * d rows from every query row is out of reach); ``edges`` by the
number of edges that fall in the tile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmattn import _checks as checks
from mmattn._jagged import runs_of
from mmattn._masks_grid import axis_window
from mmattn.patterns._attributes import Modality, _names
from mmattn.patterns._base import Bound, Pattern
from mmattn.patterns._context import Rule, Tiles, TokenContext, k_axis, q_axis

__all__ = ["neighborhood", "edges"]


def _within(q_lo: Tensor, q_hi: Tensor, k_lo: Tensor, k_hi: Tensor, reach: int) -> Tensor:
    """The ranges [q_lo, q_hi] and [k_lo, k_hi] (query / key axis) are at most ``reach``
    apart."""
    return (k_axis(k_lo) <= q_axis(q_hi + reach)) & (q_axis(q_lo) <= k_axis(k_hi + reach))


class Neighborhood(Pattern):
    """NATTEN windows among the tokens of each image grid (DESIGN, third wave)."""

    def __init__(self, kernel_size: tuple[int, int], dilation: tuple[int, int]) -> None:
        self.kernel_size, self.dilation = kernel_size, dilation

    def prepare(self, ctx: TokenContext) -> Rule:
        g = ctx.grid("P.neighborhood")
        (kh, kw), (dh, dw) = self.kernel_size, self.dilation
        gid = g.gid
        # per token (B, L), each axis: dilation subgrid, place in it, window [start, stop)
        axes = [axis_window(g.row, g.rows, kh, dh), axis_window(g.col, g.cols, kw, dw)]
        dilated = [d > 1 for d in (dh, dw)]

        def rule(b: Tensor, q: Tensor, k: Tensor) -> Tensor:
            gq = gid[b, q]
            allowed = (gq == gid[b, k]) & (gq >= 0)
            for (sub, idx, start, stop), apart in zip(axes, dilated):
                ik = idx[b, k]
                allowed = allowed & (ik >= start[b, q]) & (ik < stop[b, q])
                if apart:  # (without dilation, every position is in subgrid 0)
                    allowed = allowed & (sub[b, k] == sub[b, q])
            return allowed

        return rule

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        g = ctx.grid("P.neighborhood")
        (kh, kw), (dh, dw) = self.kernel_size, self.dilation
        inside = g.gid >= 0
        lo, hi = tiles.span("grid-id", g.gid, inside)
        may = _within(lo, hi, lo, hi, 0)  # some grid in common
        for key, values, reach in (("grid-row", g.row, (kh - 1) * dh),
                                   ("grid-col", g.col, (kw - 1) * dw)):
            lo, hi = tiles.span(key, values, inside)
            may = may & _within(lo, hi, lo, hi, reach)
        lo, hi = tiles.span("grid-id-all", g.gid)
        single = (lo == hi) & (lo >= 0)
        must = (q_axis(lo) == k_axis(lo)) & q_axis(single) & k_axis(single)
        if (dh, dw) == (1, 1):  # a kernel as large as the grid sees all of it
            _, rows_hi = tiles.span("grid-rows", g.rows)
            _, cols_hi = tiles.span("grid-cols", g.cols)
            must = must & (q_axis(rows_hi) <= kh) & (q_axis(cols_hi) <= kw)
        else:
            must = must & False
        return may, must

    def __repr__(self) -> str:
        return f"neighborhood({self.kernel_size}, dilation={self.dilation})"


class Edges(Pattern):
    """Key j → query i for every edge (j, i) of ``meta["edge_index"]``; self loops if asked."""

    def __init__(self, self_loops: bool) -> None:
        self.self_loops = checks.check_bool("self_loops", self_loops)

    def prepare(self, ctx: TokenContext) -> Rule:
        sources, starts, counts, degree = ctx.cached("edge-rows", lambda: edge_rows(ctx))
        last = max(sources.shape[0] - 1, 0)
        steps = [1 << i for i in reversed(range(degree.bit_length()))]  # powers of 2 <= degree
        self_loops = self.self_loops

        def rule(b: Tensor, q: Tensor, k: Tensor) -> Tensor:
            start, count = starts[b, q], counts[b, q]
            stop = start + count
            # binary lifting: pos = start + the number of the query's sources below k
            pos = start
            for step in steps:
                ahead = pos + step
                below = sources[(ahead - 1).clamp(max=last)] < k
                pos = torch.where((ahead <= stop) & below, ahead, pos)
            hit = (pos < stop) & (sources[pos.clamp(max=last)] == k)
            return hit | (q == k) if self_loops else hit

        return rule

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        def build() -> Tensor:
            keys = ctx.edges()
            length, n, s = ctx.length, tiles.count, tiles.block
            b, rest = keys // (length * length), keys % (length * length)
            tile = (b * n + (rest // length) // s) * n + (rest % length) // s
            counts = torch.bincount(tile, minlength=ctx.batch * n * n)
            return counts.view(ctx.batch, n, n) > 0

        may = ctx.cached(("edge-tiles", tiles.block), build)
        if self.self_loops:
            may = may | ((tiles.k_lo <= tiles.q_hi) & (tiles.q_lo <= tiles.k_hi))
        return may, torch.zeros_like(may[:1, :1, :1])

    def __repr__(self) -> str:
        return f"edges(self_loops={self.self_loops})"


def edge_rows(ctx: TokenContext) -> tuple[Tensor, Tensor, Tensor, int]:
    """The edges grouped by query (target) token: (sources (E,), starts (B, L), counts
    (B, L), the largest count). Query (b, i) attends ``sources[starts[b, i] : starts[b, i] +
    counts[b, i]]``, in increasing order (one host read: the largest count)."""
    keys = ctx.edges()  # sorted (b * L + target) * L + source
    length = max(ctx.length, 1)
    rows, sources = keys // length, keys % length
    counts, starts = runs_of(rows, ctx.batch * ctx.length)
    degree = int(counts.max()) if counts.numel() else 0
    if sources.numel() == 0:  # a lookup table that the rule may read (count 0: never hits)
        sources = torch.zeros(1, dtype=torch.long, device=ctx.device)
    shape = (ctx.batch, ctx.length)
    return sources, starts.view(shape), counts.view(shape), degree


def neighborhood(
    kernel_size: int | tuple[int, int],
    dilation: int | tuple[int, int] = 1,
    modality: str | tuple[str, ...] | None = None,
) -> Pattern:
    """NATTEN neighbourhood windows among the tokens of each image grid.

    Semantics of :class:`~mmattn.NeighborhoodAttention` (``na2d``): along an axis, a
    query's window is min(k, m) consecutive positions of its dilation subgrid, centred and
    shifted inward at the borders; the query at (r, c) attends the product of its row and
    column windows inside its own grid. Tokens outside every grid match nothing. Grids come
    from ``meta["grid"]`` / ``meta["grids"]`` (image tokens alone, from position 0) or
    ``meta[name]["grid"]`` placed at ``meta["spans"][name]`` (fused); ``modality`` keeps
    the grids of those modalities only (the same as ``& P.modality(m, m)``).

    Args:
        kernel_size: odd k or (kh, kw).
        dilation: d >= 1 or (dh, dw).
        modality: a name, a tuple of names, or None (every grid).

    Raises:
        TypeError / ValueError: an even kernel, a dilation < 1; on use, no grid in the meta
            (the message names ``"grid"``).

    Examples:
        >>> from mmattn import Tokens, patterns as P
        >>> t = Tokens(torch.zeros(1, 4, 8), meta={"grid": (1, 4)})
        >>> P.neighborhood((1, 3)).dense(t)[0].int().tolist()
        [[1, 1, 1, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 1]]
    """
    kernel = checks.check_kernel("kernel_size", kernel_size)
    dilation = checks.check_pair("dilation", dilation, what="(rows, cols)")
    names = _names("modality", modality)
    pattern: Pattern = Neighborhood(kernel, dilation)
    return pattern if names is None else pattern & Modality(names, names)


def edges(self_loops: bool = True) -> Pattern:
    """Attention along graph edges: query i attends key j for every edge (j, i).

    Edges come from ``meta["edge_index"]`` ((2, E), sources then targets, in the flat token
    order ``b * L + i``: GraphNodeSequencer and MultiModalEncoder set it); duplicates count
    once and edges between two items are ignored. With ``self_loops`` every token also
    attends itself (as :class:`~mmattn.EdgeAttention`'s default).

    Raises:
        TypeError: ``self_loops`` is not a bool. ValueError (on use): no
            ``meta["edge_index"]``.

    Examples:
        >>> from mmattn import Tokens, patterns as P
        >>> t = Tokens(torch.zeros(1, 3, 8), meta={"edge_index": torch.tensor([[0], [2]])})
        >>> P.edges().dense(t)[0].int().tolist()
        [[1, 0, 0], [0, 1, 0], [1, 0, 1]]
    """
    return Edges(self_loops)
