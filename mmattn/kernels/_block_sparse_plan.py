"""The tile plan of the block-sparse kernel: the non-empty tiles of a compiled pattern in
buckets of equal key-tile count (:func:`plan_tiles`, once per mask and model width).

Axis key: ``b`` batch, ``i``/``j`` query/key length, ``s`` tile width, ``n`` tiles per axis,
``N`` query tiles of a bucket, ``c`` key tiles per query tile of a bucket.

    query tiles ─count their key tiles─▶ groups of equal count ─packed.plan─▶ buckets
    bucket: N query tiles x c key tiles each (short rows padded with masked tiles)
        q rows (N s) · k rows (N c s) · allowed (N, 1, s, c s) · live rows

:mod:`mmattn.kernels.block_sparse` runs a plan; the CPU fused path keeps its own state on
it (``TilePlan.cpu``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mmattn._helpers import ceil_div
from mmattn._jagged import runs_of
from mmattn.kernels import dense as _dense
from mmattn.kernels import packed as _packed
from mmattn.kernels._block_sparse_cpu import CpuPlan

#: Items the bucket planner sees at most (query tiles of equal count are grouped to fit).
PLAN_ITEMS = 64


@dataclass
class Bucket:
    """N query tiles, each with ``count`` key tiles (padding slots masked).

    Attributes:
        count: key tiles per query tile (c).
        q_tiles: (N,) query tiles in the flat (b n) tile order (tile t holds the rows
            t s .. t s + s - 1 of the flat (b * padded length) layout).
        k_tiles: (N c,) their key tiles, query tile by query tile.
        slots: (N, c, 3) (b, query tile, key tile) of each slot (padding: a real tile).
        allowed: (N, 1, s, c s) bool, True where the pair may attend.
        all_live: every row has an allowed key (None: not known, the live rows are applied).
    """

    count: int
    q_tiles: Tensor
    k_tiles: Tensor
    slots: Tensor
    allowed: Tensor
    all_live: bool | None = None
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def tiles(self) -> int:
        return self.slots.shape[0]

    @property
    def block(self) -> int:
        return self.allowed.shape[2]

    @property
    def q_rows(self) -> Tensor:
        """(N s,) the flat rows of the query tiles."""
        return (self.q_tiles[:, None] * self.block + torch.arange(
            self.block, device=self.q_tiles.device)).reshape(-1)

    @property
    def k_rows(self) -> Tensor:
        """(N c s,) the flat rows of the key tiles."""
        return (self.k_tiles[:, None] * self.block + torch.arange(
            self.block, device=self.k_tiles.device)).reshape(-1)

    def fused_mask(self, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """The additive mask with dead rows opened, and the live rows (None: all live)."""
        if dtype not in self._masks:
            self._masks[dtype] = additive(self.allowed, dtype, self.all_live)
        return self._masks[dtype]


def additive(
    allowed: Tensor, dtype: torch.dtype, all_live: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(mask, live): ``allowed`` as 0 / -inf with rows without a key opened (dense.py's
    dead-row policy), and those rows' (.., s, 1) live flags (None when ``all_live``; not read
    back from the device here: unknown, the flags are returned)."""
    live = _dense.live_rows(allowed)
    opened = _dense.open_dead_rows(allowed, live)
    mask = torch.zeros(opened.shape, dtype=dtype, device=opened.device)
    mask = mask.masked_fill(~opened, float("-inf"))
    return mask, (None if all_live else live)


@dataclass
class TilePlan:
    """Everything :func:`attend` needs besides the tensors (see :func:`plan_tiles`).

    Attributes:
        batch, length, block, padded: B, L, s and the padded length n s.
        buckets: the buckets, in gather order.
        q_tiles, k_tiles: every bucket's tiles, one after another (one gather each).
        tile_rows: (B n,) for every query tile, its place in the buckets' stacked outputs
            (tiles without keys point one past the end, at a zero tile).
        seen: (B padded,) bool, keys that some query may attend (others are zeroed).
        density: non-empty tiles over all tiles.
        cpu: the CPU fused path's own state (:class:`~mmattn.kernels._block_sparse_cpu.
            CpuPlan`: its tiles, parts and gather buffers).
    """

    batch: int
    length: int
    block: int
    padded: int
    buckets: tuple[Bucket, ...]
    q_tiles: Tensor
    k_tiles: Tensor
    tile_rows: Tensor
    seen: Tensor
    all_seen: bool
    density: float
    cpu: CpuPlan = field(repr=False)


def plan_tiles(
    batch: int, length: int, block: int, full_tiles: Tensor, mixed_tiles: Tensor,
    mixed_masks: Tensor, *, width: int,
) -> TilePlan:
    """Bucket the non-empty tiles for :func:`attend` (packed.py's planner decides the cuts).

    Args:
        batch, length, block: B, L and the tile width s.
        full_tiles: (F, 3) (b, query tile, key tile) allowed throughout.
        mixed_tiles: (P, 3) the other non-empty tiles; mixed_masks (P, s, s) their masks.
        width: the model width (sets the planner's fixed cost of one call).
    """
    s, n = block, ceil_div(length, block)
    padded, device = n * s, mixed_masks.device
    buckets = bucketize(batch, length, s, full_tiles, mixed_tiles, mixed_masks, width)
    offsets = torch.arange(s, device=device)
    q_tiles = torch.cat([bk.q_tiles for bk in buckets]) if buckets else offsets[:0]
    k_tiles = torch.cat([bk.k_tiles for bk in buckets]) if buckets else offsets[:0]
    tile_rows = torch.full((batch * n,), q_tiles.shape[0], dtype=torch.long, device=device)
    tile_rows[q_tiles] = torch.arange(q_tiles.shape[0], device=device)
    seen, all_seen = seen_keys(batch, length, s, full_tiles, mixed_tiles, mixed_masks)
    total = full_tiles.shape[0] + mixed_tiles.shape[0]
    density = total / (batch * n * n) if batch * n else 0.0
    return TilePlan(batch, length, s, padded, tuple(buckets), q_tiles, k_tiles, tile_rows, seen,
                    all_seen, density, CpuPlan((full_tiles, mixed_tiles, mixed_masks, width)))


def seen_keys(batch: int, length: int, block: int, full_tiles: Tensor, mixed_tiles: Tensor,
              mixed_masks: Tensor) -> tuple[Tensor, bool]:
    """(B padded,) bool: the keys some query may attend (every key of a full tile, the
    attended columns of a mixed one; rows past L are never read), and whether that is every
    key of the first L (one host read).

    Shape:
        - full_tiles: (F, 3), mixed_tiles: (P, 3) (b, query tile, key tile); mixed_masks
          (P, s, s)
    """
    s, device = block, mixed_masks.device
    padded = ceil_div(length, s) * s
    offsets = torch.arange(s, device=device)
    seen = torch.zeros(batch * padded, dtype=torch.bool, device=device)
    key_rows = (full_tiles[:, 0] * padded + full_tiles[:, 2] * s)[:, None] + offsets
    seen[key_rows.reshape(-1)] = True
    key_rows = (mixed_tiles[:, 0] * padded + mixed_tiles[:, 2] * s)[:, None] + offsets
    attended = mixed_masks.view(torch.uint8).amax(dim=1).bool()  # (P, s); amax: the fast one
    seen[key_rows[attended]] = True
    return seen, bool(seen.view(batch, padded)[:, :length].all())


def dead_tiles(
    count: int, s: int, full_tiles: Tensor, mixed_tiles: Tensor, mixed_masks: Tensor, n: int,
) -> Tensor:
    """(b n,) bool: the query tiles with a row that none of their key tiles allows (a full
    tile allows every row; a mixed tile the rows its mask has a True in)."""
    live = torch.zeros(count, s, dtype=torch.uint8, device=mixed_masks.device)
    rows = mixed_masks.view(torch.uint8).amax(dim=2)  # (P, s)
    index = (mixed_tiles[:, 0] * n + mixed_tiles[:, 1])[:, None].expand_as(rows)
    live.scatter_reduce_(0, index, rows, "amax")
    live[full_tiles[:, 0] * n + full_tiles[:, 1]] = 1
    return (live == 0).any(dim=1)


def bucketize(
    batch: int, length: int, s: int, full_tiles: Tensor, mixed_tiles: Tensor,
    mixed_masks: Tensor, width: int,
) -> list[Bucket]:
    """The buckets of these tiles (see :func:`plan_tiles`)."""
    n = ceil_div(length, s)
    device = mixed_masks.device
    tiles = torch.cat([full_tiles, mixed_tiles]).to(device)
    kind = torch.cat([
        torch.full((full_tiles.shape[0],), -1, dtype=torch.long, device=device),
        torch.arange(mixed_tiles.shape[0], device=device),
    ])
    query_tile = tiles[:, 0] * n + tiles[:, 1]
    order = torch.argsort(query_tile * n + tiles[:, 2])
    tiles, kind, query_tile = tiles[order], kind[order], query_tile[order]
    counts, starts = runs_of(query_tile, batch * n)
    busy = counts.nonzero().squeeze(1)
    busy = busy[torch.argsort(counts[busy], descending=True, stable=True)]
    groups = _groups(busy, counts[busy].tolist(), s)
    cuts = _packed.plan(
        [len(g) * s for g, _ in groups], [c * s for _, c in groups],
        call_cost=_packed.call_work(device) / max(width, 1),
    )
    offsets = torch.arange(s, device=device)
    # every slot's (s, s) mask, gathered from one bank: full, empty (a padding slot), full
    # up to L (the last key tile), then the mixed tiles' exact masks
    full = torch.ones(1, s, s, dtype=torch.bool, device=device)
    bank = torch.cat([full, ~full, full & (offsets < length - (n - 1) * s), mixed_masks])
    kind = torch.where(kind >= 0, kind + 3, torch.where(tiles[:, 2] == n - 1, 2, 0))
    buckets = []
    for cut in cuts:
        qt = torch.cat([groups[m][0] for m in cut.items])
        c = max(groups[m][1] for m in cut.items)
        slot = torch.arange(c, device=device)
        valid = slot < counts[qt][:, None]  # (N, c)
        idx = torch.where(valid, starts[qt][:, None] + slot, starts[qt][:, None])
        kj = tiles[idx, 2]
        b, qi = qt // n, qt % n
        allowed = bank[torch.where(valid, kind[idx], 1)]  # (N, c, s, s)
        buckets.append(Bucket(
            count=c,
            q_tiles=qt,
            k_tiles=(b[:, None] * n + kj).reshape(-1),
            slots=torch.stack([b[:, None].expand_as(kj), qi[:, None].expand_as(kj), kj], -1),
            allowed=allowed.permute(0, 2, 1, 3).reshape(qt.shape[0], 1, s, c * s),
        ))
    if buckets:  # which buckets have a row without any key: one read for all of them
        dead = dead_tiles(batch * n, s, full_tiles, mixed_tiles, mixed_masks, n)
        flags = torch.stack([dead[bk.q_tiles].any() for bk in buckets]).tolist()
        for bucket, has_dead in zip(buckets, flags):
            bucket.all_live = not has_dead
    return buckets


def _groups(busy: Tensor, counts: list[int], block: int) -> list[tuple[Tensor, int]]:
    """Query tiles (sorted by count, descending) in groups of one count, at most
    ``ceil(len / PLAN_ITEMS)`` each, so the planner sees about PLAN_ITEMS items."""
    size = max(1, math.ceil(len(counts) / PLAN_ITEMS))
    groups, start = [], 0
    while start < len(counts):
        stop = start
        while stop < len(counts) and counts[stop] == counts[start] and stop - start < size:
            stop += 1
        groups.append((busy[start:stop], counts[start]))
        start = stop
    return groups
