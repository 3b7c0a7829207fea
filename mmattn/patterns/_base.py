"""``Pattern``: which query token may attend which key token, with its two faces.

Axis key: ``b`` batch, ``i`` query position, ``j`` key position, ``n``/``m`` query/key tiles.

Every pattern is a small object with two faces (FlexAttention's ``mask_mod`` beside its
``BlockMask``):

- :meth:`Pattern.prepare` — the exact rule on broadcastable index tensors ``b, q, k`` (True
  = may attend), as a closure: every per-token table it reads is built in ``prepare``, the
  closure only indexes and compares (so FlexAttention compiles it, also when its first use
  is traced). It serves :meth:`~Pattern.dense` (indices over the whole (B, L, L) grid),
  :meth:`~Pattern.compile` (indices inside the mixed tiles only) and
  :meth:`~Pattern.mask_mod` (FlexAttention's indices); :meth:`Pattern.rule` calls it;
- :meth:`Pattern.bound` — for every (query tile, key tile) of a block size, two booleans
  from per-tile ranges: ``may`` (some pair of the tile may be allowed) and ``must`` (every
  pair is allowed). A tile is empty where not ``may``, full where ``must``, mixed between.

Combinators combine both faces: ``a & b`` (may = may_a & may_b, must = must_a & must_b),
``a | b`` (likewise with ``|``) and ``~a`` (may = ~must_a, must = ~may_a). The bounds stay
sound, so only mixed tiles need the exact rule. Padding is one more rule that every pattern
is ANDed with at the top: a padded key or a padded query row never attends, also under ``~``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mmattn.patterns._context import (
    Bound,
    Chunk,
    Rule,
    Tiles,
    TokenContext,
    lookup,
    with_padding,
)
from mmattn.patterns._segments import SegmentForm
from mmattn.patterns._sparse_mask import SparseMask, compile_pattern
from mmattn.tokens import Tokens

__all__ = ["Pattern"]


class Pattern:
    """Which query token may attend which key token (True = may attend, the SDPA direction).

    Build patterns from the primitives of :mod:`mmattn.patterns` and the combinators ``&``,
    ``|``, ``~``; then :meth:`dense` gives the (B, L, L) reference, :meth:`compile` the
    :class:`~mmattn.patterns.SparseMask` that attention layers run on, and :meth:`mask_mod`
    the same rule for FlexAttention. A subclass implements :meth:`rule` and :meth:`bound`.

    Examples:
        >>> from mmattn import patterns as P
        >>> p = P.causal() & P.window(1)
        >>> p.dense(Tokens(torch.zeros(1, 4, 8)))[0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """

    # ------------------------------------------------------------------ the two faces

    def prepare(self, ctx: TokenContext) -> Rule:
        """The exact rule of these tokens as a closure ``rule(b, q, k)``: True where query
        ``q`` of item ``b`` may attend key ``k``.

        Build every tensor the rule reads here (per-token ids, tables, ...); the closure only
        indexes those tensors and compares: no tensor is made inside it, no host sync, no
        lazy cache filled. ``b``, ``q``, ``k`` are integer index tensors that broadcast
        together; the result has (at most) their broadcast shape. Padding is not its
        business. The default calls :meth:`rule` (a subclass implements one of the two).
        """
        return lambda b, q, k: self.rule(ctx, b, q, k)

    def prepared(self, ctx: TokenContext) -> Rule:
        """:meth:`prepare`, built once per context (combinators call this)."""
        return ctx.cached(("prepared", id(self)), lambda: self.prepare(ctx))

    def rule(self, ctx: TokenContext, b: Tensor, q: Tensor, k: Tensor) -> Tensor:
        """The exact rule: True where query ``q`` of item ``b`` may attend key ``k``.

        ``b``, ``q``, ``k`` are int64 index tensors that broadcast together; the result has
        (at most) their broadcast shape. Padding is not this method's business. The default
        runs :meth:`prepare`'s closure.
        """
        if type(self).prepare is Pattern.prepare:
            raise NotImplementedError(
                f"{type(self).__name__} must implement rule(ctx, b, q, k) or prepare(ctx)")
        return self.prepared(ctx)(b, q, k)

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        """(may, must), each broadcastable to (B, n, m): some / every pair of the tile is
        allowed by :meth:`rule`. ``may`` may be True for an empty tile and ``must`` False for
        a full one (both then count as mixed and are evaluated exactly), never the reverse.
        """
        raise NotImplementedError

    def tile_bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        """:meth:`bound`, computed once per context and block size (combinators call this)."""
        return ctx.cached(("bound", id(self), tiles.block), lambda: self.bound(ctx, tiles))

    def tile_rule(self, chunk: Chunk, b: Tensor, q: Tensor, k: Tensor) -> Tensor:
        """:meth:`rule` on the tiles of ``chunk`` only; ``b``, ``q``, ``k`` index their
        pairs. Combinators skip a part whose bound already decides every one of these tiles
        (``chunk.decided``: looked up, no host sync)."""
        return self.prepared(chunk.ctx)(b, q, k)

    def children(self, ctx: TokenContext) -> tuple[Pattern, ...]:
        """The patterns this one is made of (none for a primitive)."""
        return ()

    def segment_form(self, ctx: TokenContext) -> SegmentForm | None:
        """This pattern as segment-wise attention (segment ids, causal, a window) for the
        varlen engine (``patterns/_segments.py``), or None (the default: it is not)."""
        return None

    def skip_checks(self) -> tuple[tuple[Pattern, bool], ...]:
        """The (part, must) decisions :meth:`tile_rule` asks ``chunk.decided`` for."""
        return ()

    # ------------------------------------------------------------------ combinators

    def __and__(self, other: object) -> Pattern:
        return And(self, _check_pattern("&", other))

    def __rand__(self, other: object) -> Pattern:
        return And(_check_pattern("&", other), self)

    def __or__(self, other: object) -> Pattern:
        return Or(self, _check_pattern("|", other))

    def __ror__(self, other: object) -> Pattern:
        return Or(_check_pattern("|", other), self)

    def __invert__(self) -> Pattern:
        return Not(self)

    def __bool__(self) -> bool:
        raise TypeError(
            "a Pattern has no truth value: combine patterns with & | ~ (not 'and', 'or', "
            "'not'), and test for None with 'is None'"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ------------------------------------------------------------------ using it

    def dense(self, tokens: Tokens) -> Tensor:
        """The reference: the (B, L, L) "may attend" mask of these tokens.

        Padded keys and padded query rows are False. Packed Tokens give the mask of their
        padded layout (``tokens.unpack()``).

        Shape:
            - returns: (B, L, L) bool

        Raises:
            TypeError: ``tokens`` is not Tokens.
            ValueError: the meta lacks a key the pattern reads (the message names it).
        """
        ctx = TokenContext(tokens)
        b = torch.arange(ctx.batch, device=ctx.device)[:, None, None]
        pos = ctx.positions
        allowed = with_padding(self, ctx, b, pos[None, :, None], pos[None, None, :])
        return allowed.expand(ctx.batch, ctx.length, ctx.length).contiguous()

    def compile(self, tokens: Tokens, block_size: int = 64) -> SparseMask:
        """Classify every (query tile, key tile) and evaluate only the mixed ones exactly.

        No (L, L) tensor is built: each primitive bounds a tile from per-tile ranges, and
        the exact rule runs on the mixed tiles alone, a chunk of them at a time.

        Args:
            tokens: the Tokens the attention will run on (their mask and meta).
            block_size: the tile width (any L; the last tile may be short).

        Returns:
            A :class:`~mmattn.patterns.SparseMask` for ``MultiHeadAttention(...,
            attn_mask=...)`` and the blocks.

        Raises:
            TypeError / ValueError: bad ``block_size``; a meta key missing.
        """
        return compile_pattern(self, tokens, block_size)

    def mask_mod(self, tokens: Tokens) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
        """This rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for these tokens.

        It includes the padding rule, so ``create_block_mask(p.mask_mod(tokens), B, None, L,
        L)`` allows exactly what :meth:`dense` does (the head index is ignored). Every table
        it reads is built here (:meth:`prepare`); inside, it only indexes and compares, so
        ``torch.compile(flex_attention)`` compiles it, also when its first use is traced
        (``create_block_mask(..., _compile=True)``), and under a plain ``torch.vmap``. See
        docs/patterns.md, "On a GPU".

        An index past the tokens allows nothing: torch 2.5's ``create_block_mask`` rounds the
        lengths up to whole blocks and calls the mask_mod there, so the lookups read the
        indices clamped to the last token (a 0-d tensor bound, data like the tables).

        Returns:
            ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on integer index tensors.
        """
        ctx = TokenContext(tokens)
        rule = self.prepared(ctx)
        real = None if ctx.all_real else ctx.real
        last = torch.tensor(ctx.length - 1, device=ctx.device)

        def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            q, k = torch.minimum(q_idx, last), torch.minimum(kv_idx, last)
            allowed = rule(b, q, k) & (q == q_idx) & (k == kv_idx)
            if real is None:
                return allowed
            return allowed & lookup(real, b, q) & lookup(real, b, k)

        return mask_mod


def _check_pattern(op: str, other: object) -> Pattern:
    if not isinstance(other, Pattern):
        raise TypeError(
            f"Pattern {op} expects a Pattern on both sides (e.g. P.causal() {op} "
            f"P.window(8)), got {type(other).__name__}"
        )
    return other


class And(Pattern):
    """``a & b``: both allow the pair."""

    def __init__(self, a: Pattern, b: Pattern) -> None:
        self.parts = (a, b)

    def prepare(self, ctx: TokenContext) -> Rule:
        first, second = (p.prepared(ctx) for p in self.parts)
        return lambda b, q, k: first(b, q, k) & second(b, q, k)

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        (may_a, must_a), (may_b, must_b) = (p.tile_bound(ctx, tiles) for p in self.parts)
        return may_a & may_b, must_a & must_b

    def tile_rule(self, chunk: Chunk, b: Tensor, q: Tensor, k: Tensor) -> Tensor:
        first, second = self.parts
        if chunk.decided(first, must=True):  # allows all: the other decides
            return second.tile_rule(chunk, b, q, k)
        if chunk.decided(second, must=True):
            return first.tile_rule(chunk, b, q, k)
        return first.tile_rule(chunk, b, q, k) & second.tile_rule(chunk, b, q, k)

    def children(self, ctx: TokenContext) -> tuple[Pattern, ...]:
        return self.parts

    def skip_checks(self) -> tuple[tuple[Pattern, bool], ...]:
        return tuple((part, True) for part in self.parts)

    def segment_form(self, ctx: TokenContext) -> SegmentForm | None:
        first, second = (p.segment_form(ctx) for p in self.parts)
        return None if first is None else first.join(second)

    def __repr__(self) -> str:
        return f"({self.parts[0]!r} & {self.parts[1]!r})"


class Or(Pattern):
    """``a | b``: either allows the pair."""

    def __init__(self, a: Pattern, b: Pattern) -> None:
        self.parts = (a, b)

    def prepare(self, ctx: TokenContext) -> Rule:
        first, second = (p.prepared(ctx) for p in self.parts)
        return lambda b, q, k: first(b, q, k) | second(b, q, k)

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        (may_a, must_a), (may_b, must_b) = (p.tile_bound(ctx, tiles) for p in self.parts)
        return may_a | may_b, must_a | must_b

    def tile_rule(self, chunk: Chunk, b: Tensor, q: Tensor, k: Tensor) -> Tensor:
        first, second = self.parts
        if chunk.decided(first, must=False):  # allows none: the other decides
            return second.tile_rule(chunk, b, q, k)
        if chunk.decided(second, must=False):
            return first.tile_rule(chunk, b, q, k)
        return first.tile_rule(chunk, b, q, k) | second.tile_rule(chunk, b, q, k)

    def children(self, ctx: TokenContext) -> tuple[Pattern, ...]:
        return self.parts

    def skip_checks(self) -> tuple[tuple[Pattern, bool], ...]:
        return tuple((part, False) for part in self.parts)

    def __repr__(self) -> str:
        return f"({self.parts[0]!r} | {self.parts[1]!r})"


class Not(Pattern):
    """``~a``: the pairs ``a`` does not allow (padding still never attends)."""

    def __init__(self, a: Pattern) -> None:
        self.part = a

    def prepare(self, ctx: TokenContext) -> Rule:
        part = self.part.prepared(ctx)
        return lambda b, q, k: ~part(b, q, k)

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        may, must = self.part.tile_bound(ctx, tiles)
        return ~must, ~may

    def tile_rule(self, chunk: Chunk, b: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return ~self.part.tile_rule(chunk, b, q, k)

    def children(self, ctx: TokenContext) -> tuple[Pattern, ...]:
        return (self.part,)

    def __invert__(self) -> Pattern:
        return self.part

    def __repr__(self) -> str:
        return f"~{self.part!r}"
