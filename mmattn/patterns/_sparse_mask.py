"""``SparseMask``: a pattern compiled for one batch of Tokens, tile by tile.

Axis key: ``b`` batch, ``n``/``m`` query/key tiles, ``s`` tile width (block size), ``t``
tiles.

Compiling (:func:`compile_pattern`)::

    pattern & padding ─bound─▶ (B, n, m) may / must ──▶ empty | full | mixed
    mixed tiles ─rule on (t, s, s) indices, a chunk at a time─▶ exact masks; empty ones drop

A SparseMask holds the full tiles, the non-empty mixed tiles and their exact (s, s) masks:
never an (L, L) tensor (:meth:`SparseMask.dense` builds one on request). The attention
kernel (:mod:`mmattn.kernels.block_sparse`) plans its buckets from it once per model width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn import _checks as checks
from mmattn._helpers import ceil_div
from mmattn.kernels import block_sparse as _kernel
from mmattn.patterns import _flex
from mmattn.patterns._context import Chunk, Tiles, TokenContext, padding_bound, with_padding
from mmattn.patterns._segments import segment_source
from mmattn.tokens import Tokens

__all__ = ["SparseMask"]

#: Most (query, key) pairs evaluated in one exact pass over mixed tiles.
CHUNK_PAIRS = 1 << 18  # 256 KiB of bools: the passes stay in cache


class SparseMask:
    """A :class:`~mmattn.patterns.Pattern` compiled for one batch: which tiles to attend.

    Made by ``pattern.compile(tokens, block_size)``; pass it as ``attn_mask`` to
    :class:`~mmattn.MultiHeadAttention` (self-attention) or let ``TransformerBlock`` /
    ``Encoder`` / ``MultiModalEncoder(pattern=...)`` compile it. The direction is SDPA's
    (True = may attend), as ``pattern.dense``; the module treats it as the pattern itself,
    whatever its ``attn_mask`` convention for tensors.

    Attributes:
        block_size: the tile width.
        shape: (B, L, L).
        nonempty_blocks: tiles that hold at least one allowed pair, counted over the batch.
        density: ``nonempty_blocks`` over all B * ceil(L / s)² tiles.
        full_tiles: (F, 3) int64 (b, query tile, key tile) of the tiles allowed throughout.
        mixed_tiles: (P, 3) int64 of the other non-empty tiles; ``mixed_masks`` (P, s, s)
            bool their exact masks (positions past L are False).

    Examples:
        >>> from mmattn import Tokens, patterns as P
        >>> mask = P.causal().compile(Tokens(torch.zeros(2, 100, 8)), block_size=32)
        >>> mask.shape, mask.nonempty_blocks, round(mask.density, 3)
        ((2, 100, 100), 20, 0.625)
        >>> bool((mask.dense() == P.causal().dense(Tokens(torch.zeros(2, 100, 8)))).all())
        True
    """

    def __init__(
        self, batch: int, length: int, block_size: int, full_tiles: Tensor, mixed_tiles: Tensor,
        mixed_masks: Tensor,
    ) -> None:
        self.batch, self.length, self.block_size = batch, length, block_size
        self.full_tiles, self.mixed_tiles, self.mixed_masks = full_tiles, mixed_tiles, mixed_masks
        self._cache: dict[Any, Any] = {}
        #: a segment-wise pattern's facts for the varlen engine (patterns/_segments.py)
        self.segment_source: Any = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.batch, self.length, self.length)

    @property
    def device(self) -> torch.device:
        return self.mixed_masks.device

    @property
    def tiles_per_axis(self) -> int:
        return ceil_div(self.length, self.block_size)

    @property
    def nonempty_blocks(self) -> int:
        return int(self.full_tiles.shape[0] + self.mixed_tiles.shape[0])

    @property
    def density(self) -> float:
        total = self.batch * self.tiles_per_axis**2
        return self.nonempty_blocks / total if total else 0.0

    def __repr__(self) -> str:
        return (
            f"SparseMask(shape={self.shape}, block_size={self.block_size}, "
            f"nonempty_blocks={self.nonempty_blocks}, density={self.density:.3f})"
        )

    def dense(self) -> Tensor:
        """The (B, L, L) bool mask (True = may attend), equal to ``pattern.dense(tokens)``."""
        n, s = self.tiles_per_axis, self.block_size
        grid = torch.zeros(self.batch, n, n, s, s, dtype=torch.bool, device=self.device)
        if self.full_tiles.numel():
            b, qi, kj = self.full_tiles.unbind(1)
            grid[b, qi, kj] = True
        if self.mixed_tiles.numel():
            b, qi, kj = self.mixed_tiles.unbind(1)
            grid[b, qi, kj] = self.mixed_masks
        full = grid.permute(0, 1, 3, 2, 4).reshape(self.batch, n * s, n * s)
        return full[:, : self.length, : self.length].contiguous()

    def to(self, device: torch.device | str) -> SparseMask:
        """The same mask with its tensors on ``device`` (a segment-wise pattern's facts too,
        so the varlen engine takes it there as it would a mask compiled on that device)."""
        moved = SparseMask(
            self.batch, self.length, self.block_size, self.full_tiles.to(device),
            self.mixed_tiles.to(device), self.mixed_masks.to(device),
        )
        source = self.segment_source
        if source is not None:
            moved.segment_source = dataclasses.replace(
                source, ids=source.ids.to(device), real=source.real.to(device))
        return moved

    def block_mask(self) -> Any:
        """This mask as a FlexAttention ``BlockMask`` (built once, then cached).

        Its ``BLOCK_SIZE`` is :attr:`block_size`; the full tiles are its full blocks and the
        mixed tiles its partial blocks (``BlockMask.from_kv_blocks``), and its ``mask_mod``
        looks the partial tiles' exact masks up (True inside full tiles). Nothing of L·L
        elements is built: its tables hold one entry per tile.

        Returns:
            ``torch.nn.attention.flex_attention.BlockMask`` for ``flex_attention(q, k, v,
            block_mask=...)`` with q, k, v of shape (B, H, L, E).

        Raises:
            ValueError: :attr:`block_size` is not a multiple of 16 (FlexAttention's compiled
                CPU kernel is not exact below 16), or on CUDA not a power of two (flex's
                CUDA kernel tiles only those).

        Examples:
            >>> from mmattn import Tokens, patterns as P
            >>> bm = P.causal().compile(Tokens(torch.zeros(1, 40, 8)), block_size=16).block_mask()
            >>> bm.BLOCK_SIZE, bm.kv_num_blocks.flatten().tolist()
            ((16, 16), [1, 1, 1])
        """
        return self.cached("block_mask", lambda: _flex.build_block_mask(self))

    def plan(self, width: int) -> _kernel.TilePlan:
        """The kernel's bucket plan for a model of this width (built once, then cached)."""
        key = int(width)
        return self.cached(("plan", key), lambda: _kernel.plan_tiles(
            self.batch, self.length, self.block_size, self.full_tiles, self.mixed_tiles,
            self.mixed_masks, width=key,
        ))

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per mask and key: what the kernels and engines derive from this
        mask (the bucket plan of a width, the BlockMask, the engines' facts), kept with it."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def compile_pattern(pattern: Any, tokens: Tokens, block_size: int = 64) -> SparseMask:
    """``pattern.compile(tokens, block_size)``: see :meth:`Pattern.compile`.

    A few vectorised passes and a constant number of host reads (the two tile lists, the
    combinators' skip decisions for every chunk at once, the non-empty mixed tiles), however
    many tiles there are.
    """
    block = checks.check_positive_int("block_size", block_size)
    ctx = TokenContext(tokens)
    tiles = Tiles(ctx, block)
    n = tiles.count
    may, must = pattern.tile_bound(ctx, tiles)
    padding = padding_bound(ctx, tiles)
    if padding is not None:
        may, must = may & padding[0], must & padding[1]
    shape = (ctx.batch, n, n)
    may, must = may.expand(shape), must.expand(shape)
    full_tiles = must.nonzero()
    candidates = (may & ~must).nonzero()
    per_chunk = max(1, CHUNK_PAIRS // (block * block))
    decisions = skip_decisions(pattern, ctx, tiles, candidates, per_chunk)
    masks = torch.empty(candidates.shape[0], block, block, dtype=torch.bool, device=ctx.device)
    offsets = torch.arange(block, device=ctx.device)
    last = max(ctx.length - 1, 0)
    for start, decided in zip(range(0, candidates.shape[0], per_chunk), decisions):
        chunk = candidates[start:start + per_chunk]
        b, qi, kj = chunk.unbind(1)
        q = qi[:, None, None] * block + offsets[None, :, None]  # (t, s, 1)
        k = kj[:, None, None] * block + offsets[None, None, :]  # (t, 1, s)
        exact = with_padding(pattern, ctx, b[:, None, None], q.clamp(max=last),
                             k.clamp(max=last), chunk=Chunk(ctx, decided))
        if ctx.length % block:  # the last tiles reach past L
            exact = exact & (q < ctx.length) & (k < ctx.length)
        masks[start:start + chunk.shape[0]] = exact
    keep = masks.flatten(1).any(dim=1).nonzero().squeeze(1)  # the non-empty ones
    mask = SparseMask(ctx.batch, ctx.length, block, full_tiles, candidates[keep], masks[keep])
    mask.segment_source = segment_source(pattern, ctx)
    return mask


def skip_decisions(
    pattern: Any, ctx: TokenContext, tiles: Tiles, candidates: Tensor, per_chunk: int,
) -> list[dict[tuple[int, bool], bool]]:
    """For every chunk of ``per_chunk`` candidate tiles, the combinators' decisions
    ``{(id(part), must): every tile of the chunk is decided}`` (``Chunk.decided``), read
    from the device in one transfer."""
    chunks = ceil_div(candidates.shape[0], per_chunk)
    asked: dict[tuple[int, bool], tuple[Any, bool]] = {}
    seen: set[int] = set()

    def walk(node: Any) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        for part, must in node.skip_checks():
            asked[(id(part), must)] = (part, must)
        for child in node.children(ctx):
            walk(child)

    walk(pattern)
    if not asked or not chunks:
        return [{} for _ in range(chunks)]
    b, qi, kj = candidates.unbind(1)
    shape = (ctx.batch, tiles.count, tiles.count)
    rows = []
    for part, must in asked.values():
        may_all, must_all = part.tile_bound(ctx, tiles)
        grid = must_all if must else ~may_all
        rows.append(grid.expand(shape)[b, qi, kj])
    flags = torch.stack(rows)  # (asked, t)
    flags = F.pad(flags, (0, chunks * per_chunk - flags.shape[1]), value=True)
    table = flags.view(len(rows), chunks, per_chunk).all(dim=-1).T.tolist()  # one read
    keys = list(asked)
    return [dict(zip(keys, row)) for row in table]
