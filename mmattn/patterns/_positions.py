"""Primitives on positions: ``full``, ``causal``, ``window``, ``chunked``.

Axis key: ``b`` batch, ``q``/``k`` query/key positions (0..L-1), ``n``/``m`` query/key tiles.

Each class is one rule and its tile bound, from the first and last position of each tile
(``tiles.q_lo`` .. ``tiles.q_hi``, ``tiles.k_lo`` .. ``tiles.k_hi``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmattn import _checks as checks
from mmattn.patterns._base import Bound, Pattern
from mmattn.patterns._context import Rule, Tiles, TokenContext, k_axis, q_axis
from mmattn.patterns._frames import CausalBy
from mmattn.patterns._segments import SegmentForm

__all__ = ["full", "causal", "window", "chunked"]


def _const(ctx: TokenContext, value: bool) -> Tensor:
    return torch.full((1, 1, 1), value, dtype=torch.bool, device=ctx.device)


class Full(Pattern):
    """Every query attends every key."""

    def prepare(self, ctx: TokenContext) -> Rule:
        return lambda b, q, k: (q == q) & (k == k)

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        return _const(ctx, True), _const(ctx, True)

    def __repr__(self) -> str:
        return "full()"


class Causal(Pattern):
    """Key k <= query q."""

    def prepare(self, ctx: TokenContext) -> Rule:
        return lambda b, q, k: k <= q

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        return tiles.k_lo <= tiles.q_hi, tiles.k_hi <= tiles.q_lo

    def segment_form(self, ctx: TokenContext) -> SegmentForm:
        return SegmentForm(causal=True)

    def __repr__(self) -> str:
        return "causal()"


class Window(Pattern):
    """|q - k| <= w."""

    def __init__(self, w: int) -> None:
        self.w = checks.check_positive_int("w", w, minimum=0)

    def prepare(self, ctx: TokenContext) -> Rule:
        w = self.w
        return lambda b, q, k: (q - k).abs() <= w

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        w = self.w
        may = (tiles.k_lo <= tiles.q_hi + w) & (tiles.q_lo <= tiles.k_hi + w)  # nearest <= w
        must = (tiles.q_hi - w <= tiles.k_lo) & (tiles.k_hi <= tiles.q_lo + w)  # farthest
        return may, must

    def segment_form(self, ctx: TokenContext) -> SegmentForm:
        return SegmentForm(window=self.w)

    def __repr__(self) -> str:
        return f"window({self.w})"


class Chunked(Pattern):
    """Chunks of ``chunk`` tokens counted from the segment start: cq - left <= ck <= cq + right."""

    def __init__(self, chunk: int, left: int, right: int) -> None:
        self.chunk = checks.check_positive_int("chunk", chunk)
        self.left = checks.check_positive_int("left", left, minimum=0)
        self.right = checks.check_positive_int("right", right, minimum=0)

    def _chunks(self, ctx: TokenContext) -> Tensor:
        return ctx.cached(("chunks", self.chunk), lambda: ctx.offsets() // self.chunk)

    def prepare(self, ctx: TokenContext) -> Rule:
        chunks = self._chunks(ctx)
        # each query's lowest and highest key chunk as tables: inside, lookups and compares
        # only (a Python int, or arithmetic with a scalar, beside a lookup makes inductor's
        # CPU flex kernel fail to build under dynamic shapes; docs/decisions.md)
        lo, hi = chunks - self.left, chunks + self.right

        def rule(b: Tensor, q: Tensor, k: Tensor) -> Tensor:
            ck = chunks[b, k]
            return (ck >= lo[b, q]) & (ck <= hi[b, q])

        return rule

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        lo, hi = tiles.span(("chunks", self.chunk), self._chunks(ctx))
        q_lo, q_hi, k_lo, k_hi = q_axis(lo), q_axis(hi), k_axis(lo), k_axis(hi)
        may = (k_hi >= q_lo - self.left) & (k_lo <= q_hi + self.right)
        must = (k_lo >= q_hi - self.left) & (k_hi <= q_lo + self.right)
        return may, must

    def __repr__(self) -> str:
        return f"chunked({self.chunk}, left={self.left}, right={self.right})"


def full() -> Pattern:
    """Every query may attend every (real) key.

    Examples:
        >>> from mmattn import Tokens, patterns as P
        >>> P.full().dense(Tokens(torch.zeros(1, 3, 4))).all().item()
        True
    """
    return Full()


def causal(by: str | None = None) -> Pattern:
    """Query q may attend key k iff k <= q (positions in the sequence); with ``by``, iff
    ``ids[k] <= ids[q]`` for the per-token ids ``meta[by]``.

    ``by="frames"`` (VideoPatcher's frame index of each tubelet) lets every token see its
    whole frame and every earlier frame of its item, as frame-causal video models do; any
    meta key of (B, L) integer ids works ("chunks", "images", ...), also each span's own
    ``meta[name][by]`` in fused Tokens (placed at the span). Negative ids attend and are
    attended by nothing, as in :func:`same`. It streams frame by frame with a
    :class:`~mmattn.cache.ChunkCache` (docs/patterns.md, "Frame-causal video").

    Args:
        by: None (positions), or a meta key of per-token integer ids.

    Raises:
        TypeError: ``by`` is neither None nor a str. ValueError (on use): the meta lacks
            ``by`` (the message names it), ids of another shape than (B, L).

    Examples:
        >>> from mmattn import Tokens, patterns as P
        >>> P.causal().dense(Tokens(torch.zeros(1, 3, 4)))[0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
        >>> frames = torch.tensor([[0, 0, 1, 1, -1]])
        >>> t = Tokens(torch.zeros(1, 5, 4), meta={"frames": frames})
        >>> P.causal(by="frames").dense(t)[0].int().tolist()
        [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]
    """
    return Causal() if by is None else CausalBy(by)


def window(w: int) -> Pattern:
    """Query q may attend key k iff |q - k| <= w (a band of 2w + 1 keys).

    Raises:
        TypeError / ValueError: ``w`` is not an int >= 0.

    Examples:
        >>> from mmattn import Tokens, patterns as P
        >>> P.window(1).dense(Tokens(torch.zeros(1, 4, 4)))[0].int().tolist()
        [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
    """
    return Window(w)


def chunked(chunk: int, left: int = 0, right: int = 0) -> Pattern:
    """Streaming chunks: q in chunk cq may attend k in chunk ck iff cq - left <= ck <= cq + right.

    Chunks hold ``chunk`` tokens counted from the start of each token's segment (its span,
    or its run of ``meta["segments"]``); from position 0 on tokens without spans or
    segments, and for tokens outside every segment.

    Raises:
        TypeError / ValueError: ``chunk`` not an int >= 1, ``left``/``right`` not ints >= 0.

    Examples:
        >>> from mmattn import Tokens, patterns as P
        >>> P.chunked(2, left=1).dense(Tokens(torch.zeros(1, 5, 4)))[0].int().tolist()
        [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    """
    return Chunked(chunk, left, right)
