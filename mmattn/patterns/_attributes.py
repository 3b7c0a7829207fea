"""Primitives on token attributes: ``same``, ``modality``; ``per_modality``; ``runs``.

Axis key: ``b`` batch, ``l`` length, ``q``/``k`` query/key positions, ``n``/``m`` query/key
tiles, ``M`` modalities.

The bounds come from per-tile ranges of the ids (``same``) and from which modalities occur
in a tile (``modality``); ``per_modality`` is built from them with ``& | ~`` alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mmattn import _checks as checks
from mmattn.patterns._base import Bound, Pattern
from mmattn.patterns._context import Chunk, Rule, Tiles, TokenContext, k_axis, lookup, q_axis
from mmattn.patterns._positions import Full
from mmattn.patterns._segments import SegmentForm

__all__ = ["same", "modality", "per_modality", "runs"]


class Same(Pattern):
    """``ids[b, q] == ids[b, k]`` with ``ids = meta[key]``; negative ids match nothing."""

    def __init__(self, key: str) -> None:
        if not isinstance(key, str):
            raise TypeError(f"key must be a meta key (str), got {type(key).__name__}")
        self.key = key

    def ids(self, ctx: TokenContext) -> Tensor:
        return ctx.ids(self.key)

    def prepare(self, ctx: TokenContext) -> Rule:
        ids = self.ids(ctx)

        def rule(b: Tensor, q: Tensor, k: Tensor) -> Tensor:
            iq = lookup(ids, b, q)
            return (iq == lookup(ids, b, k)) & (iq >= 0)

        return rule

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        ids = self.ids(ctx)
        # the ranges of the ids >= 0 meet (a tile without any has lo > hi: they cannot)
        lo, hi = tiles.span(("same", self.key), ids, ids >= 0)
        may = (q_axis(lo) <= k_axis(hi)) & (k_axis(lo) <= q_axis(hi))
        # one id >= 0 throughout both tiles, the same one
        lo, hi = tiles.span(("same-all", self.key), ids)
        single = (lo == hi) & (lo >= 0)
        must = (q_axis(lo) == k_axis(lo)) & q_axis(single) & k_axis(single)
        return may, must

    def segment_form(self, ctx: TokenContext) -> SegmentForm:
        return SegmentForm(ids=self.ids(ctx))

    def __repr__(self) -> str:
        return f"same({self.key!r})"


class SameSegment(Same):
    """Both tokens in the same segment (a span, or a ``meta["segments"]`` id >= 0)."""

    def __init__(self) -> None:
        self.key = "segments"

    def ids(self, ctx: TokenContext) -> Tensor:
        return ctx.require_segments("P.per_modality")

    def __repr__(self) -> str:
        return "same_segment()"


def _names(name: str, value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list, set, frozenset)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"{name} must be a modality name, a tuple of names or None, got {value!r}")


class Modality(Pattern):
    """The query's modality is in ``query`` and the key's in ``key`` (None = any token)."""

    def __init__(self, query: tuple[str, ...] | None, key: tuple[str, ...] | None) -> None:
        self.query, self.key = query, key

    @staticmethod
    def _table(ctx: TokenContext, wanted: tuple[str, ...] | None) -> Tensor:
        """(M + 1,) bool: whether modality index -1, 0, ..., M - 1 is wanted."""
        _, names = ctx.modalities()
        table = [wanted is None] + [wanted is None or n in wanted for n in names]
        return torch.tensor(table, dtype=torch.bool, device=ctx.device)

    def prepare(self, ctx: TokenContext) -> Rule:
        ids, _ = ctx.modalities()
        # (B, L) bool per side: the token's modality is wanted (None: every token is)
        wq, wk = (None if wanted is None else self._table(ctx, wanted)[ids + 1]
                  for wanted in (self.query, self.key))
        if wq is None and wk is None:
            return lambda b, q, k: (q == q) & (k == k)
        if wq is None:
            return lambda b, q, k: lookup(wk, b, k)
        if wk is None:
            return lambda b, q, k: lookup(wq, b, q)
        return lambda b, q, k: lookup(wq, b, q) & lookup(wk, b, k)

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        ids, names = ctx.modalities()
        present = tiles.present("modality", ids, len(names))  # (B, n, M + 1)
        bounds = []
        for wanted in (self.query, self.key):
            table = self._table(ctx, wanted)
            bounds.append(((present & table).any(-1), ~(present & ~table).any(-1)))
        (may_q, must_q), (may_k, must_k) = bounds
        return q_axis(may_q) & k_axis(may_k), q_axis(must_q) & k_axis(must_k)

    def __repr__(self) -> str:
        return f"modality(query={self.query!r}, key={self.key!r})"


def same(key: str) -> Pattern:
    """Tokens whose ``meta[key]`` ids are equal: ``meta[key][b, q] == meta[key][b, k]``.

    ``meta[key]`` is a (B, L) integer tensor; negative ids match nothing (e.g.
    ``"documents"`` for several documents packed in one row, -1 between them).

    Raises:
        TypeError: ``key`` is not a str. ValueError (on use): the meta lacks ``key``.

    Examples:
        >>> from mmattn import Tokens, patterns as P
        >>> t = Tokens(torch.zeros(1, 4, 8), meta={"documents": torch.tensor([[0, 0, 1, -1]])})
        >>> P.same("documents").dense(t)[0].int().tolist()
        [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    """
    return Same(key)


def modality(query: str | tuple[str, ...] | None = None,
             key: str | tuple[str, ...] | None = None) -> Pattern:
    """The query token's modality is in ``query`` and the key token's in ``key``.

    A name or a tuple of names; None = any token. Modalities come from ``meta["spans"]``
    (the span names) or ``meta["modality_ids"]`` indexing ``meta["modalities"]``; a name
    that the tokens do not have matches nothing.

    Raises:
        TypeError: ``query``/``key`` not a name, a tuple of names or None. ValueError (on
            use): the meta has neither spans nor modality ids.

    Examples:
        >>> from mmattn import Tokens, patterns as P
        >>> t = Tokens.cat({"text": Tokens(torch.zeros(1, 2, 4)),
        ...                 "image": Tokens(torch.zeros(1, 1, 4))})
        >>> P.modality(query="text", key="image").dense(t)[0].int().tolist()
        [[0, 0, 1], [0, 0, 1], [0, 0, 0]]
    """
    return Modality(_names("query", query), _names("key", key))


def per_modality(within: Mapping[str, Pattern], across: Pattern | None = None) -> Pattern:
    """One pattern per modality inside each segment, another across segments.

    A pair in the same segment (a span, or a run of ``meta["segments"]``) uses
    ``within[its modality]`` (:func:`full` where the modality is not named); a pair in
    different segments uses ``across`` (default :func:`full`). Two tokens both outside any
    segment (id -1) count as different segments. Built from ``&``, ``|``, ``~`` of
    :func:`same`-segment and :func:`modality` rules, on each batch from the modalities it
    has (a modality left out of a call needs no grid or edges).

    Raises:
        TypeError: ``within`` is not a mapping of names to Patterns; ``across`` is not a
            Pattern. ValueError (on use): the meta has no spans / segments / modalities.

    Examples:
        >>> from mmattn import Tokens, patterns as P
        >>> t = Tokens.cat({"text": Tokens(torch.zeros(1, 2, 4)),
        ...                 "image": Tokens(torch.zeros(1, 2, 4))})
        >>> p = P.per_modality(within={"text": P.causal()}, across=P.modality(key="text"))
        >>> p.dense(t)[0].int().tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    """
    if not isinstance(within, Mapping):
        raise TypeError(f"within must map modality names to Patterns, got {type(within).__name__}")
    for name, pattern in within.items():
        if not isinstance(name, str) or not isinstance(pattern, Pattern):
            raise TypeError(
                f"within must map modality names to Patterns, got {name!r}: "
                f"{type(pattern).__name__}"
            )
    across = Full() if across is None else across
    if not isinstance(across, Pattern):
        raise TypeError(f"across must be a Pattern, got {type(across).__name__}")
    return PerModality(dict(within), across)


class PerModality(Pattern):
    """``per_modality``: on each batch, ``(same segment & inside) | (~same segment &
    across)`` where ``inside`` is ``within[m]`` for the query's modality m (full where not
    named). Only the modalities the tokens have are composed, so the pattern of a modality
    left out of a call (its grid or edges absent too) is never read."""

    def __init__(self, within: dict[str, Pattern], across: Pattern) -> None:
        self.within, self.across = within, across

    def composed(self, ctx: TokenContext) -> Pattern:
        def build() -> Pattern:
            _, names = ctx.modalities()
            segment = SameSegment()
            inside: Pattern = ~Modality(tuple(self.within), None)  # not named: full
            for name, pattern in self.within.items():
                if name in names:
                    inside = inside | (Modality((name,), None) & pattern)
            return (segment & inside) | (~segment & self.across)

        return ctx.cached(("per-modality", id(self)), build)

    def bound(self, ctx: TokenContext, tiles: Tiles) -> Bound:
        return self.composed(ctx).tile_bound(ctx, tiles)

    def prepare(self, ctx: TokenContext) -> Rule:
        return self.composed(ctx).prepared(ctx)

    def tile_rule(self, chunk: Chunk, b: Tensor, q: Tensor, k: Tensor) -> Tensor:
        return self.composed(chunk.ctx).tile_rule(chunk, b, q, k)

    def children(self, ctx: TokenContext) -> tuple[Pattern, ...]:
        return (self.composed(ctx),)

    def __repr__(self) -> str:
        return f"per_modality(within={self.within!r}, across={self.across!r})"


def runs(ids: Tensor) -> Tensor:
    """Segment ids from per-token type ids: one id per contiguous run of equal ids.

    For transformers-style ``token_type_ids`` (Gemma 3: 0 text, 1 image): each image and
    each stretch of text between them becomes its own segment, numbered 0, 1, ... along each
    row; negative ids (none) stay -1.

    Shape:
        - ids: (..., L) integer; returns (..., L) int64

    Raises:
        TypeError: ``ids`` is not an integer tensor.

    Examples:
        >>> from mmattn import patterns as P
        >>> P.runs(torch.tensor([[0, 0, 1, 1, 0, -1]])).tolist()
        [[0, 0, 1, 1, 2, -1]]
    """
    checks.check_integer_dtype("ids", ids, "per-token type ids")
    if ids.dim() == 0:
        raise ValueError("ids must have at least one dimension (..., L), got a 0-D tensor")
    ids = ids.long()
    new_run = torch.ones_like(ids, dtype=torch.bool)
    new_run[..., 1:] = ids[..., 1:] != ids[..., :-1]
    number = torch.cumsum(new_run & (ids >= 0), dim=-1) - 1
    return torch.where(ids >= 0, number, -1)
