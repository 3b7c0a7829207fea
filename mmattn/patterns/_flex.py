"""A :class:`SparseMask` as a FlexAttention ``BlockMask``: the tiles mmattn already classified.

Axis key: ``b`` batch, ``h`` heads (one, broadcast), ``n``/``m`` query/key tiles, ``s`` tile
width (the SparseMask's block size), ``t`` tiles, ``P`` mixed tiles.

::

    full_tiles (F, 3) ─sort by (b, query tile, key tile), rank─▶ full_kv_indices (b, 1, n, n)
    mixed_tiles (P, 3) ─the same─▶ kv_indices (b, 1, n, n)     (the counts: kv_num_blocks)
    (b, n, n) tile table: -2 full, -1 empty, p >= 0 the mixed tile p
    mask_mod(b, h, q, k) = table[b, q // s, k // s] → mixed_masks[p, q % s, k % s] / full / empty

Everything is built with a few vectorised ops (no host sync) and nothing of L·L elements:
the tables are (b, n, n) with n = ceil(L / s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mmattn._jagged import runs_of
from mmattn.kernels.engines import FLEX_MIN_BLOCK, available, flex_block_refusal

#: Tile table entries besides a mixed tile's index.
FULL, EMPTY = -2, -1


def flex_block_size(block: int, device: torch.device) -> int:
    """``block`` when FlexAttention tiles it exactly on ``device``, else a ValueError naming
    ``block_size`` (:func:`mmattn.kernels.engines.flex_block_refusal`)."""
    why = flex_block_refusal(block, device.type)
    if why is None:
        return block
    if block % FLEX_MIN_BLOCK:
        raise ValueError(
            f"block_mask() needs block_size a multiple of {FLEX_MIN_BLOCK} (FlexAttention's "
            f"BLOCK_SIZE; below {FLEX_MIN_BLOCK} its compiled CPU kernel is not exact), got "
            f"{block}: compile the pattern with block_size=16, 32, 64 or 128"
        )
    raise ValueError(
        f"block_mask() on {device.type} needs block_size a power of two >= {FLEX_MIN_BLOCK} "
        f"({why}), got {block}: compile the pattern with block_size=64 or 128"
    )


def kv_blocks(tiles: Tensor, batch: int, n: int) -> tuple[Tensor, Tensor]:
    """(counts (b, 1, n) int32, indices (b, 1, n, n) int32) of ``tiles`` (t, 3): the key
    tiles of every query tile in increasing order, the unused slots 0 (FlexAttention reads
    only the first ``count``)."""
    device = tiles.device
    rows = tiles[:, 0] * n + tiles[:, 1]  # flat (b, query tile)
    order = torch.argsort(rows * n + tiles[:, 2])
    rows, cols = rows[order], tiles[order, 2]
    counts, starts = runs_of(rows, batch * n)
    rank = torch.arange(rows.shape[0], device=device) - starts[rows]
    indices = torch.zeros(batch * n, n, dtype=torch.int32, device=device)
    indices[rows, rank] = cols.to(torch.int32)
    return counts.to(torch.int32).view(batch, 1, n), indices.view(batch, 1, n, n)


def tile_table(batch: int, n: int, full_tiles: Tensor, mixed_tiles: Tensor) -> Tensor:
    """(b, n, n) int64: :data:`FULL`, :data:`EMPTY` or the index of the tile's mixed mask."""
    table = torch.full((batch, n, n), EMPTY, dtype=torch.long, device=mixed_tiles.device)
    b, qi, kj = full_tiles.unbind(1)
    table[b, qi, kj] = FULL
    b, qi, kj = mixed_tiles.unbind(1)
    table[b, qi, kj] = torch.arange(mixed_tiles.shape[0], device=mixed_tiles.device)
    return table


def tile_mask_mod(table: Tensor, masks: Tensor, block: int) -> Callable[..., Tensor]:
    """The exact ``mask_mod(b, h, q_idx, kv_idx)`` of the tiles: a lookup, True inside full
    tiles (pure indexing, so it compiles in FlexAttention's pointwise mask graph)."""
    if masks.shape[0] == 0:  # nothing to look up: one empty mask keeps the indexing valid
        masks = torch.zeros(1, block, block, dtype=torch.bool, device=masks.device)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        entry = table[b, q_idx // block, kv_idx // block]
        exact = masks[entry.clamp(min=0), q_idx % block, kv_idx % block]
        return torch.where(entry >= 0, exact, entry == FULL)

    return mask_mod


def build_block_mask(mask: Any) -> Any:
    """``SparseMask.block_mask()``: see there."""
    from torch.nn.attention.flex_attention import BlockMask

    block = flex_block_size(mask.block_size, mask.device)
    batch, n = mask.batch, mask.tiles_per_axis
    full_tiles = mask.full_tiles.to(mask.device)
    num, idx = kv_blocks(mask.mixed_tiles, batch, n)
    full_num, full_idx = kv_blocks(full_tiles, batch, n)
    mask_mod = tile_mask_mod(tile_table(batch, n, full_tiles, mask.mixed_tiles),
                             mask.mixed_masks, block)
    return BlockMask.from_kv_blocks(
        num, idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
        **({"seq_lengths": (mask.length, mask.length)} if available().flex_seq_lengths
           else {}),
    )
