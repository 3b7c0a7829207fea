"""Packed (variable-length) attention on jagged nested tensors, without padding the batch.

Axis key: ``b`` items in the batch, ``n`` items in a bucket, ``h`` query heads, ``k`` key
heads, ``i`` query length, ``j`` key length, ``e`` head width, ``t`` tokens of the whole
batch (``t = Σ lᵢ``).

A packed batch is a jagged ``torch.nested`` tensor (b, j*, d): one (t, d) ``values()`` buffer
and ``offsets()`` (b + 1,) where item ``m`` owns rows ``[offsets[m], offsets[m + 1])``. The
projections run on ``values()`` directly. Attention runs per *bucket* (CPU kernel)::

    items sorted by (key, query) length ─▶ split into runs of similar length (DP on cost)
    bucket ─gather rows─▶ (n, h, i_max, e) ─module._attention (mask: real keys)─▶ scatter back

Padding inside a bucket is small by construction, so the cost follows Σ lᵢ² (Σ lᵢ·w for
LocalAttention), not b·max(l)². A bucket whose items all have the same lengths needs no mask
at all (one unmasked SDPA call, causal included). Padded query rows repeat the item's own last
row and padded keys repeat its own last key (masked), so no row of another item is ever read.
An item with an empty context gives a zero attention result; an empty query gives nothing.

On CUDA, plain ``MultiHeadAttention``/``CrossAttention`` without weights, masks or appended
keys run torch's own jagged SDPA (flash / memory-efficient varlen kernels) instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mmattn import _checks as checks

# the layers import the jagged helpers from here (they live below Tokens and the kernels)
from mmattn._jagged import (  # noqa: F401
    contiguous_parts,
    is_jagged,
    jagged,
    owners,
)
from mmattn.kernels import _inputs
from mmattn.kernels import dense as _kernel
from mmattn.kernels._neighborhood_plan import ByteCache

#: Fixed cost of one attention call (forward + backward, with its gathers and bookkeeping) in
#: units of one (query, key) score of a width-1 model: a score costs about ``width`` flops
#: (q·k and p·v over all heads), and on the CPU one call costs about as much as a 40 x 40
#: score block at width 512. Narrow models therefore merge more items per call.
CALL_WORK = 1600.0 * 512
#: :data:`CALL_WORK` of the device types where it was measured apart from the CPU's. CUDA is
#: not listed: its per-call overhead is unmeasured (no GPU measured it yet, issue 33), so it
#: plans with the CPU's figure until a lent GPU measures one call.
CALL_WORK_BY_DEVICE: dict[str, float] = {}
#: Relative extra cost of a masked call over an unmasked one.
MASK_COST = 0.15
#: Most items one bucket may hold (bounds the planner's work at O(b · MAX_BUCKET)).
MAX_BUCKET = 64


def call_work(device: torch.device | str) -> float:
    """The fixed cost of one attention call on ``device``'s type (:data:`CALL_WORK_BY_DEVICE`,
    else the CPU's :data:`CALL_WORK`)."""
    return CALL_WORK_BY_DEVICE.get(torch.device(device).type, CALL_WORK)


@dataclass(frozen=True)
class Bucket:
    """Items run together: their indices, padded lengths, and whether they all match."""

    items: tuple[int, ...]
    q_len: int
    k_len: int
    uniform: bool


def plan(
    q_lens: list[int],
    k_lens: list[int],
    score_cost: Callable[[int, int], float] | None = None,
    call_cost: float = CALL_WORK / 512,
) -> list[Bucket]:
    """Group items of similar length into buckets at minimal estimated cost.

    Items are sorted by (key length, query length), longest first; the optimal split of that
    order into contiguous runs minimises Σ (n · cost(i_max, j_max) · (1 + mask) + call cost)
    by dynamic programming. Items with an empty query or key are left out (no attention).

    Args:
        q_lens, k_lens: per-item lengths.
        score_cost: cost of one padded item of lengths (i, j); default ``i · j``.
        call_cost: fixed cost of one call, in the units of ``score_cost``.
    """
    score_cost = score_cost or (lambda i, j: float(i * j))
    order = sorted(
        (m for m in range(len(q_lens)) if q_lens[m] and k_lens[m]),
        key=lambda m: (k_lens[m], q_lens[m]),
        reverse=True,
    )
    count = len(order)
    best = [0.0] + [math.inf] * count
    cut = [0] * (count + 1)
    for stop in range(1, count + 1):
        q_max, last = 0, order[stop - 1]
        uniform = True
        for start in range(stop - 1, max(-1, stop - 1 - MAX_BUCKET), -1):
            m = order[start]
            q_max = max(q_max, q_lens[m])
            k_max = k_lens[order[start]]  # sorted: the run's first item has the longest keys
            uniform = uniform and (q_lens[m], k_lens[m]) == (q_lens[last], k_lens[last])
            n = stop - start
            cost = n * score_cost(q_max, k_max) * (1.0 if uniform else 1.0 + MASK_COST)
            total = best[start] + cost + call_cost
            if total < best[stop]:
                best[stop], cut[stop] = total, start
    buckets = []
    stop = count
    while stop > 0:
        start = cut[stop]
        items = tuple(order[start:stop])
        q_max = max(q_lens[m] for m in items)
        k_max = max(k_lens[m] for m in items)
        uniform = all(q_lens[m] == q_max and k_lens[m] == k_max for m in items)
        buckets.append(Bucket(items, q_max, k_max, uniform))
        stop = start
    return buckets[::-1]


@dataclass(frozen=True)
class Layout:
    """Everything a packed call needs besides the tensors: buckets and their row indices.

    ``q_index``/``k_index`` lay the packed rows out bucket by bucket, item by item, each item
    padded to its bucket's width by repeating its own last row; one ``index_select`` gathers
    every bucket (one scatter in backward, whatever the number of buckets). ``rows`` maps each
    packed query row to its row in the bucket-by-bucket result; items left out (no key) point
    one past the end, where the caller appends a zero row. ``key_masks`` holds each bucket's
    (n, 1, 1, j) real-key mask, or None when none of its items has padded keys.
    """

    buckets: tuple[Bucket, ...]
    q_index: Tensor
    k_index: Tensor
    rows: Tensor
    key_masks: tuple[Tensor | None, ...]


def _padded_index(lens: Tensor, items: Tensor, widths: Tensor) -> tuple[Tensor, Tensor]:
    """Row indices of ``items`` each padded to its width, and each index's local position."""
    starts = F.pad(lens.cumsum(0), (1, 0))[:-1]
    total = int(widths.sum())
    slot_start = F.pad(widths.cumsum(0), (1, 0))[:-1]
    local = torch.arange(total) - slot_start.repeat_interleave(widths, output_size=total)
    last = (lens[items] - 1).clamp_min(0).repeat_interleave(widths, output_size=total)
    index = starts[items].repeat_interleave(widths, output_size=total) + torch.minimum(local, last)
    return index.clamp(max=max(int(lens.sum()) - 1, 0)), slot_start


#: Layouts by lengths: the kernels' byte-bounded, thread-safe LRU cache (a layout holds the
#: device index tensors of a batch, about 6 MB at 64 items of 4,096 tokens; 64 MiB in all).
_LAYOUTS = ByteCache(64 * 2**20)


def layout(
    q_lens: tuple[int, ...], k_lens: tuple[int, ...], k_real: tuple[int, ...], cost_key: tuple,
    width: int, device: torch.device,
) -> Layout:
    """The cached :class:`Layout` for these lengths (blocks of one model reuse it; a new
    batch's lengths are a new entry, and the oldest go once the cache holds 64 MiB).

    Args:
        q_lens, k_lens: per-item lengths to plan with (``k_lens`` counts appended keys).
        k_real: per-item real key rows (the rows that exist in the packed key).
        cost_key: ``()`` for full attention or ``(window, block, global)`` for a band.
        width: the model width (sets the fixed cost of a call, see :data:`CALL_WORK`).
        device: where the indices live.
    """
    key = (q_lens, k_lens, k_real, cost_key, width, str(device))
    found = _LAYOUTS.get(key)
    if found is None:
        found = _make_layout(q_lens, k_lens, k_real, cost_key, width, device)
        tensors = [found.q_index, found.k_index, found.rows,
                   *(m for m in found.key_masks if m is not None)]
        found = _LAYOUTS.put(key, found, sum(t.nbytes for t in tensors))
    return found


def clear_layouts() -> None:
    """Forget every cached :class:`Layout` (tests that change the planner's costs)."""
    _LAYOUTS.clear()


def _make_layout(
    q_lens: tuple[int, ...], k_lens: tuple[int, ...], k_real: tuple[int, ...], cost_key: tuple,
    width: int, device: torch.device,
) -> Layout:
    """:func:`layout` without the cache."""
    cost = _band_cost(*cost_key) if cost_key else None
    buckets = tuple(plan(list(q_lens), list(k_lens), cost, call_work(device) / max(width, 1)))
    items = torch.tensor([m for b in buckets for m in b.items], dtype=torch.long)
    q_w = torch.tensor([b.q_len for b in buckets for _ in b.items], dtype=torch.long)
    k_w = torch.tensor([b.k_len for b in buckets for _ in b.items], dtype=torch.long)
    q_lens_t = torch.tensor(q_lens, dtype=torch.long)
    k_real_t = torch.tensor(k_real, dtype=torch.long)
    q_index, q_slot = _padded_index(q_lens_t, items, q_w)
    k_index, _ = _padded_index(k_real_t, items, k_w)
    filled = int(q_w.sum())
    item_row = torch.full((len(q_lens),), filled, dtype=torch.long)
    item_row[items] = q_slot
    total = int(q_lens_t.sum())
    owner = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t, output_size=total)
    local = torch.arange(total) - F.pad(q_lens_t.cumsum(0), (1, 0))[:-1][owner]
    left_out = item_row[owner] == filled
    rows = torch.where(left_out, filled, item_row[owner] + local)
    masks = []
    for bucket in buckets:
        real = [k_real[m] for m in bucket.items]
        if all(n == bucket.k_len for n in real):
            masks.append(None)
            continue
        mask = torch.arange(bucket.k_len)[None, :] < torch.tensor(real)[:, None]
        masks.append(rearrange(mask, "n j -> n 1 1 j").to(device))
    return Layout(buckets, q_index.to(device), k_index.to(device), rows.to(device), tuple(masks))


def _band_cost(window: int, block: int, glob: int) -> Callable[[int, int], float]:
    """Cost of one padded item under a band: i · (block + 2w + g) scores, plus g · j."""

    def cost(i: int, j: int) -> float:
        return float(i * min(j, block + 2 * window + glob) + glob * j)

    return cost


def jagged_sdpa(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor, *,
    dropout_p: float, is_causal: bool, groups: int = 1,
) -> Tensor:
    """torch's jagged SDPA (flash / memory-efficient varlen on CUDA) on packed rows.

    Checked in O(1): the row tensors fit together and the offsets are 1-D integer tensors
    of one length (their values are not read: no device sync).

    Shape:
        - q: (t_q, h, e); k: (t_k, k, e); v: (t_k, k, e_v); returns (t_q, h, e_v)
    """
    _inputs.check_heads(q, k, v, "(t, h, e)")
    for name, offsets in (("q_offsets", q_offsets), ("k_offsets", k_offsets)):
        checks.check_integer_dtype(name, offsets, "item offsets")
        checks.check_rank(name, offsets, (1,), "(b + 1,)")
    if q_offsets.shape != k_offsets.shape:
        raise ValueError(
            f"q_offsets and k_offsets must describe the same items, got {q_offsets.shape[0]} "
            f"and {k_offsets.shape[0]} offsets"
        )
    qn, kn, vn = (
        jagged(t, o).transpose(1, 2) for t, o in ((q, q_offsets), (k, k_offsets), (v, k_offsets))
    )
    out = _kernel.sdpa(
        qn, kn, vn, None, dropout_p=dropout_p, is_causal=is_causal, groups=groups
    )
    report("jagged-sdpa", [], q=qn, k=kn, v=vn, mask=None, is_causal=is_causal,
           dropout_p=dropout_p, groups=groups)  # after the call: only a call that ran
    return out.transpose(1, 2).values()


def report(path: str, reasons: list[str], **facts) -> None:
    """Tell the path listeners about one packed SDPA call: ``kernel`` = ``path`` ("buckets":
    one padded bucket, "jagged-sdpa": torch's varlen kernel) and the call's tensors and mask
    (:func:`mmattn.kernels.dense.add_listener`)."""
    if _kernel.reporting():
        _kernel.report("packed", reasons, kernel=path, **facts)




def weight_tiles(record: dict, block: int = 64) -> Iterator:
    """The tiles of a jagged SDPA call's report (:func:`mmattn.kernels._report_tiles.weight_tiles`):
    each item's rows as a dense call; the rows are the packed rows (item offset + i)."""
    from mmattn.kernels._tiles import dense_tiles

    q_start = k_start = 0
    for qm, km in zip(record["q"].unbind(), record["k"].unbind()):
        for tile in dense_tiles(qm[None], km[None], None, block=block,
                                is_causal=bool(record.get("is_causal"))):
            yield tile._replace(q_ids=tile.q_ids + q_start, k_ids=tile.k_ids + k_start)
        q_start, k_start = q_start + qm.shape[1], k_start + km.shape[1]
