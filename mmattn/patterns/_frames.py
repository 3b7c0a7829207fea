"""``P.causal(by=key)``: causal over per-token ids (frames, chunks, images), not positions.

Axis key: ``b`` batch, ``q``/``k`` query/key positions, ``n``/``m`` query/key tiles.

Query q may attend key k of the same item when ``ids[k] <= ids[q]``: every token of a frame
sees its whole frame and every earlier one (video generation and world models). Negative
ids attend and are attended by nothing, as in ``P.same``. The tile bound comes from each
tile's range of ids (over the ids >= 0): a key tile whose smallest id exceeds the query
tile's largest is empty, one whose largest id is at most the query tile's smallest (all ids
>= 0) is full, so the block-sparse kernel skips the frames ahead whole.
"""

from __future__ import annotations

from torch import Tensor

from mmattn.patterns._base import Bound, Pattern
from mmattn.patterns._context import Rule, Tiles, TokenContext, k_axis, q_axis


class CausalBy(Pattern):
    """``0 <= ids[b, k] <= ids[b, q]`` with ``ids = meta[key]`` (or the spans' own)."""

    def __init__(self, key: str) -> None:
        if not isinstance(key, str):
            raise TypeError(f"by must be a meta key (str) or None, got {type(key).__name__}")
        self.key = key

    def ids(self, ctx: TokenContext) -> Tensor:
        return ctx.ids(self.key, f"P.causal(by={self.key!r})")

    def prepare(self, ctx: TokenContext) -> Rule:
        ids = self.ids(ctx)

        def rule(b: Tensor, q: Tensor, k: Tensor) -> Tensor:
            ik = ids[b, k]
            return (ik <= ids[b, q]) & (ik >= 0)  # ik >= 0 and ik <= iq: iq >= 0 too

        return rule

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        ids = self.ids(ctx)
        # over the ids >= 0 (a tile without any has lo > hi: nothing allowed)
        lo, hi = tiles.span(("same", self.key), ids, ids >= 0)
        may = k_axis(lo) <= q_axis(hi)
        # every key id <= every query id, and no negative id in either tile
        every_lo, _ = tiles.span(("same-all", self.key), ids)
        real = every_lo >= 0
        must = (k_axis(hi) <= q_axis(lo)) & q_axis(real) & k_axis(real)
        return may, must

    def __repr__(self) -> str:
        return f"causal(by={self.key!r})"
