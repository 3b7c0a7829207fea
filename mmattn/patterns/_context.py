"""What patterns read from one batch of Tokens, and the per-tile ranges their bounds use.

Axis key: ``b`` batch, ``l`` sequence length, ``n`` query tiles, ``m`` key tiles, ``s`` tile
width (the block size).

Token attributes come from ``Tokens.meta`` (DESIGN, fourth wave):

- padding: ``tokens.mask`` (True = real);
- modality and segment: ``meta["spans"]`` (one segment per span, the span's name its
  modality; ``(start, stop)`` ints, or (b,) tensors of per-item bounds, 0 <= start <= stop
  <= l, refused otherwise), else
  ``meta["modality_ids"]`` (b, l) indexing ``meta["modalities"]`` and ``meta["segments"]``
  (b, l), -1 = none;
- grids: ``meta[name]["grid"]`` / ``["grids"]`` placed at ``meta["spans"][name]``, else
  ``meta["grid"]`` / ``meta["grids"]`` from position 0 (1 to 3 sides; ``"grids"``: a list of
  them or a (b, a) integer tensor), read by :mod:`._grids`;
- per-token ids: ``meta[key]`` (b, l), or each span's ``meta[name][key]`` placed at it;
- edges: ``meta["edge_index"]`` (2, E), flat ``b * l + i``, sources then targets.

Everything is read once per :class:`TokenContext` and cached; a missing key raises a
ValueError naming it. Nothing here builds an (l, l) tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn import _checks as checks
from mmattn._helpers import ceil_div
from mmattn._token_meta import check_spans
from mmattn.patterns._grids import Grid, placed_ids, read_grid
from mmattn.tokens import Tokens

#: Larger than any position or id (pads tile minima), and its negative (pads maxima).
BIG = 2**62

#: A tile bound: (may, must), each broadcastable to (B, n, m).
Bound = tuple[Tensor, Tensor]

#: A prepared rule: ``rule(b, q, k)`` on broadcastable index tensors, pure indexing.
Rule = Callable[[Tensor, Tensor, Tensor], Tensor]


class TokenContext:
    """The token attributes of one batch (read lazily from ``tokens.meta``, cached).

    Packed Tokens are read in their padded layout (``tokens.unpack()``).

    Attributes:
        batch, length: B and L. device: of the tokens.
        real: (B, L) bool, True at real tokens; all_real: no padding at all.
        positions: (L,) int64, 0..L-1.
    """

    def __init__(self, tokens: Tokens) -> None:
        if not isinstance(tokens, Tokens):
            raise TypeError(f"tokens must be mmattn.Tokens, got {type(tokens).__name__}")
        if tokens.is_packed:
            tokens = tokens.unpack()
        self.meta: Mapping[str, Any] = tokens.meta
        self.batch, self.length = int(tokens.batch_size), int(tokens.length)
        self.device = tokens.device
        self.real = tokens.full_mask()
        self.all_real = tokens.mask is None or bool(self.real.all())
        self.positions = torch.arange(self.length, device=self.device)
        self._cache: dict[Any, Any] = {}

    def cached(self, key: Any, build: Any) -> Any:
        """``build()`` once per context and key."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def missing(self, key: str, need: str, provider: str) -> ValueError:
        """The error for a meta key a pattern needs and the tokens lack."""
        return ValueError(
            f"{need} needs meta[{key!r}] ({provider}); the tokens' meta has keys "
            f"{sorted(map(str, self.meta))}"
        )

    # ------------------------------------------------------------------ per-token ids

    def ids(self, key: str, need: str | None = None) -> Tensor:
        """``meta[key]`` as a checked (B, L) int64 tensor (for :func:`mmattn.patterns.same`,
        ``P.causal(by=key)``); in fused Tokens without it, each span's own
        ``meta[name][key]`` placed at its span (-1 elsewhere). ``need`` names the pattern
        in the error for a missing key."""
        return self.cached(("ids", key), lambda: self._ids(key, need or f"P.same({key!r})"))

    def _ids(self, key: str, need: str) -> Tensor:
        if key in self.meta:
            return self._check_ids(f"meta[{key!r}]", self.meta[key])
        placed = placed_ids(self, key, lambda name, value, width: self._check_ids(
            name, value, width))
        if placed is None:
            raise self.missing(key, need, "a (batch, length) integer tensor, or a span's "
                               f"meta[name][{key!r}]")
        return placed

    def _check_ids(self, name: str, value: object, length: int | None = None) -> Tensor:
        checks.check_tensor(name, value)
        checks.check_integer_dtype(name, value, "one id per token")
        width = self.length if length is None else length
        checks.check_shape(name, value, (self.batch, width), "(batch, length)")
        checks.check_has_data(name, value)
        return value.to(self.device, torch.long)

    def span_mask(self, start: Tensor, stop: Tensor) -> Tensor:
        """(B, L) bool: positions inside ``[start, stop)`` ((B,) tensors)."""
        return (self.positions >= start[:, None]) & (self.positions < stop[:, None])

    def spans(self) -> dict[str, tuple[Tensor, Tensor]] | None:
        """``meta["spans"]`` checked (``_token_meta.check_spans``): {name: ((B,) start,
        (B,) stop)}, or None without spans."""
        return self.cached("spans", self._spans)

    def _spans(self) -> dict[str, tuple[Tensor, Tensor]] | None:
        spans = self.meta.get("spans")
        if spans is None:
            return None
        return check_spans("meta['spans']", spans, self.batch, self.length, self.device)

    def modalities(self) -> tuple[Tensor, tuple[str, ...]]:
        """(B, L) int64 modality index of each token (-1 = none) and the names it indexes."""
        return self.cached("modalities", self._modalities)

    def _modalities(self) -> tuple[Tensor, tuple[str, ...]]:
        spans = self.spans()
        if spans is not None:
            return self._span_ids(spans), tuple(spans)
        if "modality_ids" not in self.meta:
            raise ValueError(
                "P.modality / P.per_modality need meta['spans'] (Tokens.cat of a mapping, "
                "MultiModalEncoder) or meta['modality_ids'] with meta['modalities']; the "
                f"tokens' meta has keys {sorted(map(str, self.meta))}"
            )
        ids = self._check_ids("meta['modality_ids']", self.meta["modality_ids"])
        if "modalities" not in self.meta:
            raise self.missing("modalities", "meta['modality_ids']", "the names it indexes")
        names = checks.check_names("meta['modalities']", self.meta["modalities"])
        checks.check_range("meta['modality_ids']", ids, -1, len(names), "len(modalities)")
        return ids, names

    def _span_ids(self, spans: Mapping[str, tuple[Tensor, Tensor]]) -> Tensor:
        ids = torch.full((self.batch, self.length), -1, dtype=torch.long, device=self.device)
        for index, bounds in enumerate(spans.values()):
            ids = torch.where(self.span_mask(*bounds), index, ids)
        return ids

    def segments(self) -> Tensor | None:
        """(B, L) int64 segment id of each token (-1 = none), or None without any."""
        return self.cached("segments", self._segments)

    def _segments(self) -> Tensor | None:
        spans = self.spans()
        if spans is not None:
            return self._span_ids(spans)
        if "segments" in self.meta:
            return self._check_ids("meta['segments']", self.meta["segments"])
        return None

    def require_segments(self, need: str) -> Tensor:
        """:meth:`segments`, or a ValueError naming ``"segments"`` (and ``"spans"``)."""
        segments = self.segments()
        if segments is None:
            raise ValueError(
                f"{need} needs meta['spans'] or meta['segments'] ((batch, length) int64, one "
                "id per contiguous run, -1 = none; P.runs(ids) makes them); the tokens' meta "
                f"has keys {sorted(map(str, self.meta))}"
            )
        return segments

    def offsets(self) -> Tensor:
        """(B, L) int64: each token's position counted from the start of its segment (its
        contiguous run of one segment id); from 0 without segments or outside them."""
        return self.cached("offsets", self._offsets)

    def _offsets(self) -> Tensor:
        segments = self.segments()
        pos = self.positions.expand(self.batch, self.length)
        if segments is None:
            return pos
        new_run = torch.ones_like(segments, dtype=torch.bool)
        new_run[:, 1:] = segments[:, 1:] != segments[:, :-1]
        start = torch.where(new_run, pos, 0).cummax(dim=1).values
        return torch.where(segments >= 0, pos - start, pos)

    # ------------------------------------------------------------------ geometry

    def grid(self, need: str, names: tuple[str, ...] | None = None) -> Grid:
        """Per-token grid coordinates (of the spans in ``names`` only, when given);
        ValueError naming ``"grid"`` when there is none (:func:`._grids.read_grid`)."""
        return self.cached(("grid", names), lambda: read_grid(self, need, names))

    def edges(self) -> Tensor:
        """Sorted unique pair keys ``(b * L + target) * L + source`` of ``meta["edge_index"]``
        (edges between two items of the batch are ignored)."""
        return self.cached("edges", self._edges)

    def _edges(self) -> Tensor:
        if "edge_index" not in self.meta:
            raise self.missing(
                "edge_index", "P.edges()", "(2, E) int64 in the flat b * L + i order, "
                "GraphNodeSequencer / MultiModalEncoder set it"
            )
        edges = self.meta["edge_index"]
        checks.check_integer_dtype("meta['edge_index']", edges, "token indices")
        if edges.dim() != 2 or edges.shape[0] != 2:
            raise ValueError(
                f"meta['edge_index'] must have shape (2, E), got {tuple(edges.shape)}"
            )
        checks.check_has_data("meta['edge_index']", edges)
        edges = edges.to(self.device, torch.long)
        checks.check_range("meta['edge_index']", edges, 0, self.batch * self.length, "B * L")
        source, target = edges[0], edges[1]
        length = max(self.length, 1)
        same_item = source // length == target // length
        keys = target * length + source % length
        return torch.unique(keys[same_item])  # sorted


class Tiles:
    """Per-tile ranges for the bounds: which positions a tile covers and reductions of a
    token attribute over a tile.

    Query tiles are laid along dim 1 and key tiles along dim 2 of a (B, n, m) grid: a query
    quantity has shape (.., n, 1), a key quantity (.., 1, m); bounds broadcast to (B, n, m).

    Attributes:
        block: the tile width s. count: tiles per axis (n = m = ceil(L / s)).
        q_lo, q_hi: (1, n, 1) first and last position of each query tile (last < L).
        k_lo, k_hi: (1, 1, m) the same for key tiles.
    """

    def __init__(self, ctx: TokenContext, block: int) -> None:
        self.ctx, self.block = ctx, block
        self.count = ceil_div(ctx.length, block)
        lo = torch.arange(self.count, device=ctx.device) * block
        hi = torch.clamp(lo + block - 1, max=max(ctx.length - 1, 0))
        self.q_lo, self.q_hi = lo[None, :, None], hi[None, :, None]
        self.k_lo, self.k_hi = lo[None, None, :], hi[None, None, :]
        self._cache: dict[Any, Any] = {}

    def _tiled(self, values: Tensor, fill: Any) -> Tensor:
        """(B, L) → (B, n, s), the tail padded with ``fill``."""
        pad = self.count * self.block - values.shape[1]
        if pad:
            values = F.pad(values, (0, pad), value=fill)
        return values.view(values.shape[0], self.count, self.block)

    def span(self, key: Any, values: Tensor, where: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(B, n) minimum and maximum of ``values`` (B, L) over each tile (over the tokens
        where ``where`` holds, if given: a tile without any has minimum > maximum)."""
        def build() -> tuple[Tensor, Tensor]:
            lo_src = values if where is None else torch.where(where, values, BIG)
            hi_src = values if where is None else torch.where(where, values, -BIG)
            lo = self._tiled(lo_src, BIG).amin(dim=-1)
            hi = self._tiled(hi_src, -BIG).amax(dim=-1)
            return lo, hi

        return self.ctx.cached(("span", self.block, key), build)

    def present(self, key: Any, values: Tensor, count: int) -> Tensor:
        """(B, n, count + 1) bool: which of the ids -1..count-1 occur in each tile."""
        def build() -> Tensor:
            one_hot = F.one_hot(values + 1, count + 1).bool()  # (B, L, count + 1)
            pad = self.count * self.block - values.shape[1]
            if pad:
                one_hot = F.pad(one_hot, (0, 0, 0, pad), value=False)
            return one_hot.view(values.shape[0], self.count, self.block, count + 1).any(dim=2)

        return self.ctx.cached(("present", self.block, key), build)

    def every(self, key: Any, values: Tensor) -> Tensor:
        """(B, n) bool: ``values`` (B, L) bool holds at every position of each tile."""
        return self.ctx.cached(
            ("every", self.block, key), lambda: self._tiled(values, True).all(dim=-1)
        )

    def some(self, key: Any, values: Tensor) -> Tensor:
        """(B, n) bool: ``values`` (B, L) bool holds at some position of each tile."""
        return self.ctx.cached(
            ("some", self.block, key), lambda: self._tiled(values, False).any(dim=-1)
        )


def q_axis(x: Tensor) -> Tensor:
    """A per-tile (B, n) quantity on the query axis of the (B, n, m) grid."""
    return x[:, :, None]


def k_axis(x: Tensor) -> Tensor:
    """A per-tile (B, m) quantity on the key axis of the (B, n, m) grid."""
    return x[:, None, :]


class Chunk:
    """Mixed tiles evaluated together by ``Pattern.tile_rule``, with the combinators' skip
    decisions for them, made beforehand for every chunk at once (no host sync here).

    Attributes:
        ctx: the TokenContext.
    """

    def __init__(self, ctx: TokenContext, decisions: Mapping[tuple[int, bool], bool]) -> None:
        self.ctx, self._decisions = ctx, decisions

    def decided(self, part: Any, must: bool) -> bool:
        """Whether ``part``'s bound allows every pair (``must``) / no pair (not ``must``) of
        every tile of the chunk (False when not asked beforehand)."""
        return self._decisions.get((id(part), must), False)


def with_padding(
    pattern: Any, ctx: TokenContext, b: Tensor, q: Tensor, k: Tensor, chunk: Chunk | None = None,
) -> Tensor:
    """``pattern.rule`` where both tokens are real (padded keys and rows never attend); on
    the tiles of ``chunk`` only (``pattern.tile_rule``) when given."""
    allowed = pattern.rule(ctx, b, q, k) if chunk is None else pattern.tile_rule(chunk, b, q, k)
    if ctx.all_real:
        return allowed
    real = ctx.real
    return allowed & real[b, q] & real[b, k]


def padding_bound(ctx: TokenContext, tiles: Tiles) -> Bound | None:
    """The padding rule's tile bound: some / every token of both tiles is real (None: no
    token is padding)."""
    if ctx.all_real:
        return None
    some = tiles.some("real", ctx.real)
    every = tiles.every("real", ctx.real)
    return q_axis(some) & k_axis(some), q_axis(every) & k_axis(every)
