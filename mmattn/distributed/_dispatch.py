"""Which rank attends which query tiles: balanced by their non-empty tiles.

Axis key: ``t`` query tiles in the flat ``b · n + i`` order (B items of n tiles), ``p`` ranks.

A query tile's *work* is its number of non-empty (query tile, key tile) pairs of the
:class:`~mmattn.patterns.SparseMask`: what the block-sparse kernel computes for it, forward
and backward. A cut between two query tiles *costs* the key tiles that would cross it were
its two sides on different ranks (:func:`tile_work`): after a document's first tile one (the
tile it shares with the document before), inside a causal text every tile before it.

:func:`balance` (once per mask) tries two dispatches, in this order:

1. **Borders** (:func:`borders`): P contiguous runs of equal work (within 1 %), each border
   at the cheapest cut near its balanced place. Few keys travel (P - 1 borders, at document
   starts where there are documents); kept when the ranks' rows are balanced too (at most
   1.1 times the mean: where work per row varies a lot, as along a causal text, contiguous
   runs of equal work would pile rows, hence activations, on the first ranks).
2. **Units and LPT** (:func:`units`, :func:`lpt`): contiguous runs of query tiles of work
   between cap / 2 and cap (and at most 1 / G of a rank's share of the tiles), cut at the
   cheapest place in that range; then longest processing time first (Graham 1969): units by
   decreasing work, each to a rank where it raises the busiest rank's work no more than on
   the least loaded one (of those, the one with the fewest rows), unless a rank
   already holds a neighbouring unit whose keys it mostly needs and stays within 1.02 times
   the mean work and 1.1 times the mean rows (the pieces of a long document stay together).
   The busiest rank holds at most the mean plus one unit; ``cap`` = mean work per rank / G
   for G = 8, 16, 32, ... until max / mean <= 1.02 or the units are single tiles, keeping
   the best.

Everything runs on Python ints read once per mask (one list of work per query tile and one
of cut costs): no host read per tile on the device.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate

import torch
from torch import Tensor

#: Stop refining the units once the busiest rank has at most this over the mean.
GOOD_BALANCE = 1.02
#: The first number of units per rank tried (doubled until the balance is good).
FIRST_UNITS = 8
#: A unit joins its neighbour's rank only while that rank holds at most this times the mean
#: rows (activations and memory stay balanced too).
ROW_SLACK = 1.1


def tile_work(full_tiles: Tensor, mixed_tiles: Tensor, batch: int, n: int) -> tuple[Tensor,
                                                                                     Tensor]:
    """(work (t,), cross (t + 1,)): the non-empty tiles of each query tile, and for each cut
    ``c`` (before flat query tile c) the key tiles that would have to cross it, were the two
    sides on different ranks: key tiles before it attended by a query tile after it, and
    key tiles after it attended by one before (0 at the borders of the items).

    Shape:
        - full_tiles, mixed_tiles: (F, 3), (P, 3) (b, query tile, key tile)
    """
    tiles = torch.cat([full_tiles, mixed_tiles])
    count = batch * n
    query = tiles[:, 0] * n + tiles[:, 1]
    key = tiles[:, 0] * n + tiles[:, 2]
    work = torch.bincount(query, minlength=count)
    first = torch.full((count,), count, dtype=torch.long, device=query.device)
    last = torch.full((count,), -1, dtype=torch.long, device=query.device)
    first.scatter_reduce_(0, key, query, "amin")  # the query tiles that attend key tile k
    last.scatter_reduce_(0, key, query, "amax")  # lie in first[k] .. last[k]
    used = last >= 0
    index = torch.arange(count, device=query.device)[used]
    # key tile k crosses the cuts k + 1 .. last[k] and first[k] + 1 .. k
    low = torch.cat([index + 1, first[used] + 1])
    high = torch.cat([last[used], index])
    keep = low <= high
    starts = torch.bincount(low[keep], minlength=count + 2)
    stops = torch.bincount(high[keep] + 1, minlength=count + 2)
    cross = torch.cumsum(starts - stops, 0)[: count + 1]
    return work, cross


def units(work: list[int], cross: list[int], batch: int, n: int, cap: float,
          size: int) -> list[tuple[int, int, int]]:
    """Contiguous runs ``(start, stop, work)`` of the query tiles of each item, each of work
    at most ``cap`` (a single heavier tile stands alone) and at most ``size`` tiles and,
    where the item has enough, of work at least ``cap / 2``, cut at the cheapest place (the
    fewest ``cross``; ties: the latest)."""
    out = []
    for item in range(batch):
        start, end = item * n, (item + 1) * n
        while start < end:
            pos, acc, best, best_cost = start, 0, None, None
            while pos < end:
                if (acc + work[pos] > cap or pos - start >= size) and pos > start:
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


def lpt(parts: list[tuple[int, int, int]], ranks: int, links: list[list[int]] | None = None,
        capacity: float = float("inf")) -> tuple[list[int], list[int]]:
    """Longest processing time first: (the rank of each part, the work of each rank).

    Parts go by decreasing work (ties: the earlier) to the rank with the fewest rows among
    those where it does not raise the busiest rank's work above what the least loaded rank
    would reach (LPT's step), except that a part joins a rank already holding one of its
    ``links`` (parts that share keys with it) when that rank stays within ``capacity`` work
    and ``ROW_SLACK`` times the mean rows.
    """
    order = sorted(range(len(parts)), key=lambda u: (-parts[u][2], parts[u][0]))
    loads, rows = [0] * ranks, [0] * ranks
    owner = [-1] * len(parts)
    row_capacity = sum(stop - start for start, stop, _ in parts) / ranks * ROW_SLACK
    for u in order:
        start, stop, work = parts[u]
        near = [owner[v] for v in (links[u] if links else ()) if owner[v] >= 0]
        near = [r for r in near if loads[r] + work <= capacity and
                rows[r] + stop - start <= row_capacity]
        if near:
            rank = min(near, key=lambda r: (loads[r], rows[r], r))
        else:  # no rank above what the least loaded would reach: of those, the fewest rows
            top = max(max(loads), min(loads) + work)
            rank = min((r for r in range(ranks) if loads[r] + work <= top),
                       key=lambda r: (rows[r], loads[r], r))
        owner[u] = rank
        loads[rank] += work
        rows[rank] += stop - start
    return owner, loads


def _links(parts: list[tuple[int, int, int]], cross: list[int], n: int) -> list[list[int]]:
    """For each part, its neighbours in the same item whose keys it mostly needs: the key
    tiles crossing their cut are no more than the two parts' tiles (the pieces of a long
    document; not the units of a causal text, which need every key before them anyway)."""
    links: list[list[int]] = [[] for _ in parts]
    for u in range(len(parts) - 1):
        (start, cut, _), (_, stop, _) = parts[u], parts[u + 1]
        if cut % n and 0 < cross[cut] <= stop - start:
            links[u].append(u + 1)
            links[u + 1].append(u)
    return links


def spread(loads: list[int]) -> float:
    """max / mean of the ranks' work (1.0 when there is none)."""
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


def borders(work: list[int], cross: list[int], ranks: int) -> list[int]:
    """The first tile of each rank's run, and the end (P + 1 cuts): rank k's run ends at the
    cheapest cut (least ``cross``; ties: the nearest) whose work before it is within
    ``GOOD_BALANCE - 1`` / 2 of k / P of the whole, or at the nearest cut if none is."""
    prefix = list(accumulate(work, initial=0))
    mean, count = prefix[-1] / ranks, len(work)
    slack = mean * (GOOD_BALANCE - 1) / 2
    cuts = [0]
    for k in range(1, ranks):
        target = k * mean
        low = max(bisect_left(prefix, target - slack), cuts[-1])
        high = min(bisect_right(prefix, target + slack) - 1, count)
        window = range(low, high + 1) if low <= high else [min(max(
            bisect_left(prefix, target), cuts[-1]), count)]
        cuts.append(min(window, key=lambda c: (cross[c], abs(prefix[c] - target))))
    return [*cuts, count]


def balance(work: Tensor, cross: Tensor, batch: int, n: int, ranks: int) -> Tensor:
    """The rank of every query tile (t,) int64 (see the module docstring).

    Shape:
        - work: (t,), cross: (t + 1,) from :func:`tile_work`; t = batch · n
    """
    work_list, cross_list = work.tolist(), cross.tolist()  # the one host read
    cuts = borders(work_list, cross_list, ranks)
    parts = [(a, b, sum(work_list[a:b])) for a, b in zip(cuts, cuts[1:])]
    sizes = [b - a for a, b, _ in parts]
    if spread([w for _, _, w in parts]) <= GOOD_BALANCE and \
            max(sizes) * ranks <= ROW_SLACK * len(work_list):
        return _owners(parts, list(range(ranks)), work.device)
    mean = sum(work_list) / ranks
    best = None
    per_rank = FIRST_UNITS
    while True:
        parts = units(work_list, cross_list, batch, n, max(mean / per_rank, 1.0),
                      max(len(work_list) // (ranks * per_rank), 1))
        owner, loads = lpt(parts, ranks, _links(parts, cross_list, n), mean * GOOD_BALANCE)
        score = spread(loads)
        if best is None or score < best[0]:
            best = (score, parts, owner)
        if score <= GOOD_BALANCE or len(parts) == len(work_list):
            break
        per_rank *= 2
    return _owners(best[1], best[2], work.device)


def _owners(parts: list[tuple[int, int, int]], owner: list[int],
            device: torch.device) -> Tensor:
    """(t,) the rank of every tile from the parts' ranks."""
    sizes = torch.tensor([stop - start for start, stop, _ in parts], dtype=torch.long)
    return torch.tensor(owner, dtype=torch.long).repeat_interleave(sizes).to(device)
