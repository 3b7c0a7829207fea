"""A dense boolean mask as a :class:`SparseMask`: its tiles classified in one pass.

Axis key: ``b`` batch, ``i``/``j`` query/key length, ``n`` tiles per axis, ``s`` tile width,
``w`` 8-byte words of a tile row (s / 8), ``t`` tiles.

:meth:`Pattern.compile` never sees an (L, L) tensor. Some callers already hold one: the
Hugging Face backend receives transformers' own mask. :func:`sparse_from_dense` reads such a
mask once and keeps what the block-sparse kernel needs::

    mask (b, i, j) bool ─pad to n s─▶ (b n, s, n w) int64 words (8 bools each, no copy)
        OR / AND over the s rows of every query tile ──▶ (b, n, n, w)
        any word ≠ 0: non-empty; every word = 0x0101..01: full; between: mixed
    mixed tiles ─gather─▶ (t, s, s) exact masks

The row loop reads every byte once (two integer operations per 8 bools), a few percent of
one dense attention over the same mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mmattn._helpers import ceil_div
from mmattn.patterns._sparse_mask import SparseMask

#: Eight ``True`` bools read as one little- or big-endian int64 (the same either way).
_ALL_TRUE = 0x0101010101010101


def classify_tiles(mask: Tensor, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """(tiles, nonempty, full) of a (b, i, i) bool mask, in one pass over it.

    Returns:
        tiles: the mask padded with False to n s per side, as (b, n, s, n, s) (a view when
            ``i`` is a multiple of ``block_size`` and the mask is contiguous);
        nonempty, full: (b, n, n) bool, a tile holds some / only allowed pairs (a tile that
            reaches past ``i`` is never full).
    """
    batch, length = mask.shape[0], mask.shape[-1]
    s = block_size
    n = ceil_div(length, s)
    padded = n * s
    if padded != length:
        mask = F.pad(mask, (0, padded - length, 0, padded - length), value=False)
    mask = mask.contiguous()
    tiles = mask.view(batch, n, s, n, s)
    if s % 8 == 0 and mask.data_ptr() % 8 == 0:
        words = mask.view(torch.uint8).view(torch.int64).view(batch * n, s, n * s // 8)
        empty, every = 0, _ALL_TRUE
    else:  # a tile width that is not whole words: one byte per bool
        words = mask.view(torch.uint8).view(batch * n, s, padded)
        empty, every = 0, 1
    some, all_ = words[:, 0].clone(), words[:, 0].clone()
    for row in range(1, s):
        some |= words[:, row]
        all_ &= words[:, row]
    some = rearrange(some, "(b n) (m w) -> b n m w", b=batch, m=n)
    all_ = rearrange(all_, "(b n) (m w) -> b n m w", b=batch, m=n)
    return tiles, (some != empty).any(dim=-1), (all_ == every).all(dim=-1)


def sparse_from_dense(
    mask: Tensor, block_size: int = 64, *, batch: int | None = None,
    max_density: float | None = None,
) -> SparseMask | None:
    """The :class:`SparseMask` that holds exactly ``mask`` (True = may attend).

    Args:
        mask: (b, i, i) bool.
        block_size: the tile width.
        batch: the batch the SparseMask is for, when ``mask`` has one item (b = 1) that
            every item shares; default b.
        max_density: None when more than this share of the tiles is non-empty (the mask is
            then left to a dense kernel); default: always a SparseMask.

    Shape:
        - mask: (b, i, i); ``result.dense()`` equals ``mask`` (expanded to ``batch``)
    """
    items, length = mask.shape[0], mask.shape[-1]
    batch = items if batch is None else batch
    tiles, nonempty, full = classify_tiles(mask, block_size)
    total = nonempty.numel()
    if max_density is not None and total and int(nonempty.sum()) > max_density * total:
        return None
    full_tiles = full.nonzero()
    mixed_tiles = (nonempty & ~full).nonzero()
    b, qi, kj = mixed_tiles.unbind(1)
    mixed_masks = tiles[b, qi, :, kj, :]  # (t, s, s)
    if batch != items:  # one item shared by the batch: its tiles, once per item
        full_tiles, mixed_tiles, mixed_masks = (
            _repeat(full_tiles, batch), _repeat(mixed_tiles, batch),
            mixed_masks.repeat(batch, 1, 1),
        )
    return SparseMask(batch, length, block_size, full_tiles, mixed_tiles, mixed_masks)


def _repeat(tiles: Tensor, batch: int) -> Tensor:
    """(t, 3) tiles of item 0 as (batch t, 3), item by item."""
    out = tiles.repeat(batch, 1)
    out[:, 0] = torch.arange(batch, device=tiles.device).repeat_interleave(tiles.shape[0])
    return out
