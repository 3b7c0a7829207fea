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

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mmattn._jagged import runs_of

#: The smallest tile FlexAttention runs exactly: torch 2.14's compiled CPU kernel gives wrong
#: numbers at BLOCK_SIZE=8 (even from its own create_block_mask); 16 and above are right.
MIN_FLEX_BLOCK = 16

#: Tile table entries besides a mixed tile's index.
FULL, EMPTY = -2, -1


def flex_block_size(block: int) -> int:
    """``block`` when FlexAttention runs it exactly, else a ValueError naming ``block_size``."""
    if block % MIN_FLEX_BLOCK:
        raise ValueError(
            f"block_mask() needs block_size a multiple of {MIN_FLEX_BLOCK} (FlexAttention's "
            f"BLOCK_SIZE; below {MIN_FLEX_BLOCK} its compiled CPU kernel is not exact), got "
            f"{block}: compile the pattern with block_size=16, 32, 64 or 128"
        )
    return block


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


def _from_kv_blocks_kwargs(length: int) -> dict[str, Any]:
    """The optional arguments this torch's ``BlockMask.from_kv_blocks`` takes (detected)."""
    from torch.nn.attention.flex_attention import BlockMask

    params = inspect.signature(BlockMask.from_kv_blocks).parameters
    return {"seq_lengths": (length, length)} if "seq_lengths" in params else {}


def build_block_mask(mask: Any) -> Any:
    """``SparseMask.block_mask()``: see there."""
    from torch.nn.attention.flex_attention import BlockMask

    block = flex_block_size(mask.block_size)
    batch, n = mask.batch, mask.tiles_per_axis
    full_tiles = mask.full_tiles.to(mask.device)
    num, idx = kv_blocks(mask.mixed_tiles, batch, n)
    full_num, full_idx = kv_blocks(full_tiles, batch, n)
    mask_mod = tile_mask_mod(tile_table(batch, n, full_tiles, mask.mixed_tiles),
                             mask.mixed_masks, block)
    return BlockMask.from_kv_blocks(
        num, idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
        **_from_kv_blocks_kwargs(mask.length),
    )
