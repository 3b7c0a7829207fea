"""Primitives on geometry: ``neighborhood`` (image and video grids) and ``edges`` (graphs).

Axis key: ``b`` batch, ``q``/``k`` query/key positions, ``n``/``m`` query/key tiles, ``s``
tile width.

``neighborhood`` bounds a tile, along every grid axis, by the range of its keys' places and
the union of its queries' windows there (a key tile that no query window of the tile reaches
on some axis is empty); ``edges`` by the number of edges that fall in the tile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmattn import _checks as checks
from mmattn._jagged import runs_of
from mmattn._masks_grid import axis_window, check_window, describe_window, window_axes
from mmattn.patterns._attributes import Modality, _names
from mmattn.patterns._base import Bound, Pattern
from mmattn.patterns._context import Chunk, Rule, Tiles, TokenContext, k_axis, lookup, q_axis
from mmattn.patterns._grids import Grid

__all__ = ["neighborhood", "edges"]


def _within(q_lo: Tensor, q_hi: Tensor, k_lo: Tensor, k_hi: Tensor, reach: int) -> Tensor:
    """The ranges [q_lo, q_hi] and [k_lo, k_hi] (query / key axis) are at most ``reach``
    apart."""
    return (k_axis(k_lo) <= q_axis(q_hi + reach)) & (q_axis(q_lo) <= k_axis(k_hi + reach))


class Neighborhood(Pattern):
    """NATTEN windows among the tokens of each grid (DESIGN, third and sixth waves): one
    window per axis (:func:`~mmattn._masks_grid.axis_window`), a token attends the product.
    With ``names`` only the grids of those spans count (the others' tokens match nothing).
    """

    def __init__(self, axes: int | None, kernel: tuple[int, ...], dilation: tuple[int, ...],
                 causal: tuple[bool, ...], names: tuple[str, ...] | None = None) -> None:
        self.axes, self.names = axes, names
        self.kernel_size, self.dilation, self.causal = kernel, dilation, causal

    def _grid(self, ctx: TokenContext) -> Grid:
        return ctx.grid("P.neighborhood", self.names)

    def window(self, g: Grid) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
        """Per-axis (kernel, dilation, causal) on the tokens' grids: one value on every axis,
        or the tuples on grids of as many axes (a grid with fewer has leading sides of 1)."""
        count = len(g.coords)
        if self.axes is None:
            return check_window((1,) * count, self.kernel_size[0], self.dilation[0],
                                self.causal[0])
        wider = [a for a in g.axes if a > self.axes]
        if wider:
            window = describe_window(self.kernel_size, self.dilation, self.causal)
            raise ValueError(
                f"P.neighborhood's window ({window}) has {self.axes} axes, but the tokens "
                f"hold a grid of {wider[0]} axes; give kernel_size, dilation and causal one "
                "entry per grid axis, one value for every axis, or modality= to keep the "
                "grids it is meant for"
            )
        lead = count - self.axes  # leading sides of 1 (grids of other spans)
        return ((1,) * lead + self.kernel_size, (1,) * lead + self.dilation,
                (False,) * lead + self.causal)

    def composed(self, ctx: TokenContext) -> Pattern:
        """The rule as ``same grid & axis 0 & axis 1 & ...`` (one :class:`_AxisWindow` per
        axis; no grid part when one grid holds every token): each part bounds its tiles
        alone, and the exact evaluation skips the parts whose bound already allows every
        pair of a chunk of tiles (a video tile's frames, say)."""
        def build() -> Pattern:
            g = self._grid(ctx)
            windows = self.window(g)
            parts: list[Pattern] = [] if g.whole else [_SameGrid(self)]
            parts += [_AxisWindow(self, a, *(w[a] for w in windows))
                      for a in range(len(g.coords))]
            pattern = parts[-1]
            for part in reversed(parts[:-1]):
                pattern = part & pattern
            return pattern

        return ctx.cached(("neighborhood", id(self)), build)

    def prepare(self, ctx: TokenContext) -> Rule:
        return self.composed(ctx).prepared(ctx)

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        return self.composed(ctx).tile_bound(ctx, tiles)

    def tile_rule(self, chunk: Chunk, b: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return self.composed(chunk.ctx).tile_rule(chunk, b, q, k)

    def children(self, ctx: TokenContext) -> tuple[Pattern, ...]:
        return (self.composed(ctx),)

    def __repr__(self) -> str:
        causal = f", causal={self.causal}" if any(self.causal) else ""
        kernel = self.kernel_size if self.axes else self.kernel_size[0]
        return f"neighborhood({kernel}, dilation={self.dilation}{causal})"


class _SameGrid(Pattern):
    """Both tokens in one grid (the grid ids of :class:`Neighborhood`'s grids)."""

    def __init__(self, owner: Neighborhood) -> None:
        self.owner = owner

    def prepare(self, ctx: TokenContext) -> Rule:
        gid = self.owner._grid(ctx).gid

        def rule(b: Tensor, q: Tensor, k: Tensor) -> Tensor:
            gq = lookup(gid, b, q)
            return (gq == lookup(gid, b, k)) & (gq >= 0)

        return rule

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        gid = self.owner._grid(ctx).gid
        lo, hi = tiles.span(("grid-id", id(self)), gid, gid >= 0)
        may = _within(lo, hi, lo, hi, 0)  # some grid in common
        lo, hi = tiles.span(("grid-id-all", id(self)), gid)
        single = (lo == hi) & (lo >= 0)
        return may, (q_axis(lo) == k_axis(lo)) & q_axis(single) & k_axis(single)


class _AxisWindow(Pattern):
    """Along one grid axis, the key lies in the query's window (its dilation subgrid,
    ``start <= place < stop``; :func:`~mmattn._masks_grid.axis_window`). Tokens outside
    every grid have place 0 and window [0, 1) there: :class:`_SameGrid` excludes them."""

    def __init__(self, owner: Neighborhood, axis: int, kernel: int, dilation: int,
                 causal: bool) -> None:
        self.owner, self.axis = owner, axis
        self.kernel, self.dilation, self.causal = kernel, dilation, causal

    def window(self, ctx: TokenContext) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        g = self.owner._grid(ctx)
        return ctx.cached(("axis-window", id(self)), lambda: axis_window(
            g.coords[self.axis], g.sides[self.axis], self.kernel, self.dilation, self.causal))

    def prepare(self, ctx: TokenContext) -> Rule:
        sub, idx, start, stop = self.window(ctx)
        apart = self.dilation > 1  # (without dilation, every position is in subgrid 0)

        def rule(b: Tensor, q: Tensor, k: Tensor) -> Tensor:
            ik = lookup(idx, b, k)
            inside = (ik >= lookup(start, b, q)) & (ik < lookup(stop, b, q))
            return inside & (lookup(sub, b, k) == lookup(sub, b, q)) if apart else inside

        return rule

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        sub, idx, start, stop = self.window(ctx)
        name = id(self)
        k_lo, k_hi = tiles.span(("axis-place", name), idx)
        start_lo, start_hi = tiles.span(("axis-start", name), start)
        stop_lo, stop_hi = tiles.span(("axis-stop", name), stop - 1)
        # some key's place in some query's window; every key's in every query's
        may = (k_axis(k_hi) >= q_axis(start_lo)) & (k_axis(k_lo) <= q_axis(stop_hi))
        must = (k_axis(k_lo) >= q_axis(start_hi)) & (k_axis(k_hi) <= q_axis(stop_lo))
        if self.dilation > 1:  # and one subgrid throughout both tiles
            lo, hi = tiles.span(("axis-sub", name), sub)
            one = lo == hi
            must = must & q_axis(one) & k_axis(one) & (q_axis(lo) == k_axis(lo))
        return may, must


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
            start, count = lookup(starts, b, q), lookup(counts, b, q)
            stop = start + count
            # binary lifting: pos = start + the number of the query's sources below k
            pos = start
            for step in steps:
                ahead = pos + step
                below = lookup(sources, (ahead - 1).clamp(max=last)) < k
                pos = torch.where((ahead <= stop) & below, ahead, pos)
            hit = (pos < stop) & (lookup(sources, pos.clamp(max=last)) == k)
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
    kernel_size: int | tuple[int, ...],
    dilation: int | tuple[int, ...] = 1,
    causal: bool | tuple[bool, ...] = False,
    modality: str | tuple[str, ...] | None = None,
) -> Pattern:
    """NATTEN neighbourhood windows among the tokens of each grid (image or video).

    Semantics of :class:`~mmattn.NeighborhoodAttention` (``na1d`` / ``na2d`` / ``na3d``):
    along an axis, a query's window is min(k, m) consecutive positions of its dilation
    subgrid, centred and shifted inward at the borders; on a ``causal`` axis, the (at most)
    k positions ending at the query. A query attends the product of its windows along every
    axis, inside its own grid. Tokens outside every grid match nothing. Grids (1 to 3 axes:
    ``(rows, cols)``, a video's ``(frames, rows, cols)``) come from ``meta["grid"]`` /
    ``meta["grids"]`` (tokens of one modality, from position 0) or ``meta[name]["grid"]``
    placed at ``meta["spans"][name]`` (fused); ``modality`` keeps the grids of those
    modalities only (the same as ``& P.modality(m, m)``, and a tuple kernel then ignores the
    other grids).

    Args:
        kernel_size: odd k for every axis, or one per axis ((kh, kw), (kt, kh, kw)).
        dilation: d >= 1 for every axis, or one per axis.
        causal: for every axis, or one bool per axis (``(True, False, False)``: a video's
            time axis causal).
        modality: a name, a tuple of names, or None (every grid).

    Raises:
        TypeError / ValueError: an even kernel, a dilation < 1, per-axis tuples of different
            lengths or of other than 1 to 3 entries; on use, no grid in the meta (the message
            names ``"grid"``), a grid of more axes than a tuple kernel (naming
            ``kernel_size``).

    Examples:
        >>> from mmattn import Tokens, patterns as P
        >>> t = Tokens(torch.zeros(1, 4, 8), meta={"grid": (1, 4)})
        >>> P.neighborhood((1, 3)).dense(t)[0].int().tolist()
        [[1, 1, 1, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 1]]
        >>> video = Tokens(torch.zeros(1, 3 * 2 * 2, 8), meta={"grid": (3, 2, 2)})
        >>> P.neighborhood((3, 3, 3), causal=(True, False, False)).dense(video)[0, 11].int()
        tensor([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.int32)
    """
    axes, (kernel, dilation, causal) = window_axes(kernel_size, dilation, causal)
    names = _names("modality", modality)
    pattern: Pattern = Neighborhood(axes, kernel, dilation, causal, names)
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
