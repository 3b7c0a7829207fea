"""Which rank attends which query tiles: balanced by their non-empty tiles.

Axis key: ``t`` query tiles in the flat ``b · n + i`` order (B items of n tiles), ``p`` ranks.

A query tile's *work* is its number of non-empty (query tile, key tile) pairs of the
:class:`~mmattn.patterns.SparseMask`: what the block-sparse kernel computes for it, forward
and backward. The dispatch (:func:`balance`, once per mask)::

    query tiles ─runs of work <= cap, cut where fewest tiles cross─▶ units ─LPT─▶ ranks

1. **Units**: contiguous runs of query tiles of one item, of work between cap / 2 and cap,
   cut at the place in that range where the fewest non-empty tiles cross the cut (a
   document's border: none, or the one tile it shares with the next document). A rank so
   keeps whole documents where it can, and the keys it needs from others stay few.
2. **LPT** (longest processing time first, Graham 1969): units by decreasing work, each to
   the rank with the least work so far (ties: fewer rows, then the lower rank). The busiest
   rank then has at most the mean plus one unit.
3. ``cap`` = mean work per rank / G, for G = 8, 16, 32, ... until max / mean <= 1.02 or the
   units are single tiles; the best assignment is kept.

Everything runs on Python ints read once per mask (one list of work per query tile and one
of cut costs): no host read per tile on the device.
"""

from __future__ import annotations

import heapq

import torch
from torch import Tensor

#: Stop refining the units once the busiest rank has at most this over the mean.
GOOD_BALANCE = 1.02
#: The first number of units per rank tried (doubled until the balance is good).
FIRST_UNITS = 8


def tile_work(full_tiles: Tensor, mixed_tiles: Tensor, batch: int, n: int) -> tuple[Tensor,
                                                                                     Tensor]:
    """(work (t,), cross (t + 1,)): the non-empty tiles of each query tile, and for each cut
    ``c`` (before flat query tile c) the non-empty tiles whose query and key tiles lie on
    either side of it (0 at the borders of the items).

    Shape:
        - full_tiles, mixed_tiles: (F, 3), (P, 3) (b, query tile, key tile)
    """
    tiles = torch.cat([full_tiles, mixed_tiles])
    count = batch * n
    query = tiles[:, 0] * n + tiles[:, 1]
    key = tiles[:, 0] * n + tiles[:, 2]
    work = torch.bincount(query, minlength=count)
    low, high = torch.minimum(query, key), torch.maximum(query, key)
    starts = torch.bincount(low + 1, minlength=count + 2)  # the cuts low + 1 .. high
    stops = torch.bincount(high + 1, minlength=count + 2)
    cross = torch.cumsum(starts - stops, 0)[: count + 1]
    return work, cross


def units(work: list[int], cross: list[int], batch: int, n: int,
          cap: float) -> list[tuple[int, int, int]]:
    """Contiguous runs ``(start, stop, work)`` of the query tiles of each item, each of work
    at most ``cap`` (a single heavier tile stands alone) and, where the item has enough, at
    least ``cap / 2``, cut at the cheapest place (the fewest ``cross``; ties: the latest)."""
    out = []
    for item in range(batch):
        start, end = item * n, (item + 1) * n
        while start < end:
            pos, acc, best, best_cost = start, 0, None, None
            while pos < end:
                if acc + work[pos] > cap and pos > start:
                    break
                acc += work[pos]
                pos += 1
                if acc >= cap / 2 or pos == end:
                    cost = 0 if pos == end else cross[pos]
                    if best_cost is None or cost <= best_cost:
                        best, best_cost = pos, cost
            stop = pos if best is None else best
            out.append((start, stop, sum(work[start:stop])))
            start = stop
    return out


def lpt(parts: list[tuple[int, int, int]], ranks: int) -> tuple[list[int], list[int]]:
    """Longest processing time first: (the rank of each part, the work of each rank)."""
    order = sorted(range(len(parts)), key=lambda u: (-parts[u][2], parts[u][0]))
    heap = [(0, 0, r) for r in range(ranks)]  # (work, rows, rank)
    owner = [0] * len(parts)
    for u in order:
        load, rows, rank = heapq.heappop(heap)
        start, stop, work = parts[u]
        owner[u] = rank
        heapq.heappush(heap, (load + work, rows + stop - start, rank))
    loads = [0] * ranks
    for load, _, rank in heap:
        loads[rank] = load
    return owner, loads


def spread(loads: list[int]) -> float:
    """max / mean of the ranks' work (1.0 when there is none)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


def balance(work: Tensor, cross: Tensor, batch: int, n: int, ranks: int) -> Tensor:
    """The rank of every query tile (t,) int64 (see the module docstring).

    Shape:
        - work: (t,), cross: (t + 1,) from :func:`tile_work`; t = batch · n
    """
    work_list, cross_list = work.tolist(), cross.tolist()  # the one host read
    total = sum(work_list)
    heaviest = max(work_list, default=0)
    mean = total / ranks
    best = None
    per_rank = FIRST_UNITS
    while True:
        cap = max(mean / per_rank, heaviest, 1)
        parts = units(work_list, cross_list, batch, n, cap)
        owner, loads = lpt(parts, ranks)
        score = spread(loads)
        if best is None or score < best[0]:
            best = (score, parts, owner)
        if score <= GOOD_BALANCE or cap <= max(heaviest, 1):
            break
        per_rank *= 2
    _, parts, owner = best
    sizes = torch.tensor([stop - start for start, stop, _ in parts], dtype=torch.long)
    return torch.tensor(owner, dtype=torch.long).repeat_interleave(sizes).to(work.device)
