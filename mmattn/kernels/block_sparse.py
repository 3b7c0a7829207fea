"""Block-sparse attention: only the non-empty (query tile, key tile) pairs are computed.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key heads, ``i``/``j`` query/key length,
``e`` head width, ``s`` tile width, ``n`` tiles per axis, ``N`` query tiles of a bucket,
``c`` key tiles per query tile of a bucket.

The tiles come from a compiled pattern (:class:`mmattn.patterns.SparseMask`): the full
tiles, and the mixed tiles with their exact (s, s) masks. :func:`plan_tiles` lays them out
once per mask and model width::

    query tiles ─count their key tiles─▶ groups of equal count ─packed.plan─▶ buckets
    bucket: N query tiles x c key tiles each (short rows padded with masked tiles)
        q rows (N s) · k rows (N c s) · allowed (N, 1, s, c s) · live rows

and :func:`attend` runs them: one ``index_select`` gathers the query, key and value rows of
every bucket, each bucket is one batched attention call through :mod:`mmattn.kernels.dense`
(``sdpa`` with the additive mask on the fused path; ``attend`` with its explicit twin when
weights are requested or ``MMATTN_FUSED_ATTN=0``), and one ``index_select`` puts the rows
back. Autograd runs backward through the gathers (each becomes one scatter-add).

Rows without any allowed key follow dense.py's one dead-row policy: opened before the
softmax, set to zero after (``live_rows`` / ``open_dead_rows``). Keys that no query may
attend (padding) are zeroed first, so a NaN stored there cannot reach a real output. Query
tiles without any key tile are never computed; their rows are zero.

Score modifiers: ALiBi is an (N, h, s, c s) term per bucket on the token index of the item,
added to the tile mask; sinks follow the CPU path's logsumexp merge (``TileAttention``), or
else each bucket's call (a query tile's key tiles are all in one bucket); softcap is the
explicit path, tile by tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn._helpers import ceil_div, exporting
from mmattn.kernels import dense as _dense
from mmattn.kernels import packed as _packed
from mmattn.kernels._block_sparse_cpu import DTYPES, TileAttention, rectangles
from mmattn.kernels.modifiers import Modifiers

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
    """

    count: int
    q_tiles: Tensor
    k_tiles: Tensor
    slots: Tensor
    allowed: Tensor
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
            self._masks[dtype] = additive(self.allowed, dtype)
        return self._masks[dtype]


def additive(allowed: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """(mask, live): ``allowed`` as 0 / -inf with rows without a key opened (dense.py's
    dead-row policy), and those rows' (.., s, 1) live flags (None when every row is live)."""
    live = _dense.live_rows(allowed)
    opened = _dense.open_dead_rows(allowed, live)
    mask = torch.zeros(opened.shape, dtype=dtype, device=opened.device)
    mask = mask.masked_fill(~opened, float("-inf"))
    return mask, (None if bool(live.all()) else live)


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
        tiles: (full tiles, mixed tiles, their masks, width), for the CPU fused path's own
            parts (:func:`fast_parts`).
        workspace: gather buffers of the CPU fused path, reused call after call.
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
    tiles: tuple = field(repr=False)
    workspace: dict = field(default_factory=dict, repr=False)


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
    seen = torch.zeros(batch * padded, dtype=torch.bool, device=device)
    key_rows = (full_tiles[:, 0] * padded + full_tiles[:, 2] * s)[:, None] + offsets
    seen[key_rows.reshape(-1)] = True  # (rows past L are never read)
    key_rows = (mixed_tiles[:, 0] * padded + mixed_tiles[:, 2] * s)[:, None] + offsets
    attended = mixed_masks.view(torch.uint8).amax(dim=1).bool()  # (P, s); amax: the fast one
    seen[key_rows[attended]] = True  # the keys some query of the tile attends
    total = full_tiles.shape[0] + mixed_tiles.shape[0]
    density = total / (batch * n * n) if batch * n else 0.0
    return TilePlan(batch, length, s, padded, tuple(buckets), q_tiles, k_tiles, tile_rows, seen,
                    bool(seen.view(batch, padded)[:, :length].all()), density,
                    (full_tiles, mixed_tiles, mixed_masks, width))


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
    counts = torch.bincount(query_tile, minlength=batch * n)
    starts = torch.cumsum(counts, 0) - counts
    busy = counts.nonzero().squeeze(1)
    busy = busy[torch.argsort(counts[busy], descending=True, stable=True)]
    groups = _groups(busy, counts[busy].tolist(), s)
    cuts = _packed.plan(
        [len(g) * s for g, _ in groups], [c * s for _, c in groups],
        call_cost=_packed.CALL_WORK / max(width, 1),
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


def tiled(rows: Tensor, block: int) -> Tensor:
    """(r, f) flat rows → (r / s, s f): one row per tile (a view)."""
    return rows.view(-1, block * rows.shape[1])


def _rows(x: Tensor, padded: int) -> Tensor:
    """(b, h, l, e) → (b padded, h e): the flat row layout the gathers read."""
    batch, _, length, _ = x.shape
    x = x.transpose(1, 2)
    if padded != length:
        x = F.pad(x, (0, 0, 0, 0, 0, padded - length))
    return x.reshape(batch * padded, -1)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: TilePlan,
    *,
    key_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    groups: int = 1,
    modifiers: Modifiers | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention over the planned tiles only (unchecked; the layer validates).

    Args:
        q, k, v: head-split queries, keys, values; ``k``/``v`` may have fewer heads
            (grouped-query attention, ``groups`` query heads per key head).
        plan: from ``SparseMask.plan(width)``.
        key_mask: (b, j) bool (True = may attend) or float (added), ANDed with the tiles.
        is_causal: also key j <= query i.
        dropout_p, scale, need_weights: as :func:`mmattn.kernels.dense.attend`.
        modifiers: sinks, softcap and ALiBi (ALiBi on the token index, see the module
            docstring; positions or a term set on the Modifiers are refused).

    Shape:
        - q: (b, h, i, e); k: (b, k, i, e); v: (b, k, i, e_v) — self-attention, i = j = L
        - returns: (b, h, i, e_v) and the weights (b, h, i, i) or None
    """
    batch, heads, length, _ = q.shape
    kv_heads, ev = k.shape[1], v.shape[-1]
    s, padded = plan.block, plan.padded
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    mods = _check_modifiers(modifiers)
    explicit = need_weights or not _dense.use_fused_attn() or (mods is not None and mods.explicit)
    sinks = None if mods is None else mods.sinks
    alibi = mods is not None and mods.slopes is not None
    if _dense.reporting():
        _dense.report(
            "block-sparse", _dense.explicit_reasons(need_weights, mods), q=q, k=k, v=v,
            mask=None, dropout_p=dropout_p, is_causal=is_causal, scale=scale, key_mask=key_mask,
            density=plan.density, block=s, groups=groups, modifiers=mods, plan=plan,
        )
    key_ok, key_add = _key_rows(key_mask, padded)
    q2, k2, v2 = _rows(q, padded), _rows(k, padded), _rows(v, padded)
    seen = plan.seen if key_ok is None else plan.seen & key_ok
    if key_ok is not None or not plan.all_seen:
        k2, v2 = torch.where(seen[:, None], k2, 0.0), torch.where(seen[:, None], v2, 0.0)
    extra = key_ok is not None or key_add is not None or is_causal
    if _fast(q, v, explicit, dropout_p, key_add):  # the CPU flash kernel, memory-lean
        # (ALiBi: every pair has its own term, so no rectangles without a mask)
        rects, buckets = ([], plan.buckets) if extra or alibi else fast_parts(plan)
        masks = [_with_alibi(_fused_mask(bk, extra, key_ok, key_add, is_causal, padded,
                                         q.dtype), bk, mods, padded) for bk in buckets]
        out = TileAttention.apply(
            q2, k2, v2, sinks, rects, buckets, masks, heads, kv_heads, scale, plan.workspace)
        return out.view(batch, padded, heads, ev)[:, :length].transpose(1, 2), None
    sizes_q = [bk.q_tiles.shape[0] for bk in plan.buckets]
    sizes_k = [bk.k_tiles.shape[0] for bk in plan.buckets]
    qg = tiled(q2, s).index_select(0, plan.q_tiles).split(sizes_q)  # whole tiles: fewer,
    kg = tiled(k2, s).index_select(0, plan.k_tiles).split(sizes_k)  # longer copies
    vg = tiled(v2, s).index_select(0, plan.k_tiles).split(sizes_k)
    outs, weights = [], None
    if need_weights:
        count = padded // s
        weights = q.new_zeros(batch, count, count, heads, s, s, dtype=_dense.weights_dtype(v))
    for bucket, qb, kb, vb in zip(plan.buckets, qg, kg, vg):
        tiles, width = bucket.tiles, bucket.count * s
        qb = qb.view(tiles, s, heads, -1).transpose(1, 2)
        kb = kb.view(tiles, width, kv_heads, -1).transpose(1, 2)
        vb = vb.view(tiles, width, kv_heads, ev).transpose(1, 2)
        allowed = bucket.allowed
        if extra:
            allowed = _call_allowed(bucket, allowed, key_ok, key_add, is_causal, padded)
        if explicit:
            mask = allowed
            if key_add is not None:
                mask = torch.where(allowed, 0.0, float("-inf")).to(q.dtype)
                mask = mask + key_add[bucket.k_rows].view(tiles, 1, 1, width).to(q.dtype)
            call_mods = None if mods is None else mods.with_terms(
                alibi_term(bucket, mods, padded, q.dtype))
            out, w = _dense.attend(
                qb, kb, vb, mask, dropout_p=dropout_p, scale=scale, need_weights=need_weights,
                report_path=False, groups=groups, modifiers=call_mods,
            )
            if weights is not None:
                w = w.view(tiles, heads, s, bucket.count, s).permute(0, 3, 1, 2, 4)
                slot = bucket.slots
                weights.index_put_((slot[..., 0], slot[..., 1], slot[..., 2]), w, accumulate=True)
        else:
            mask, live = _with_alibi(
                _fused_mask(bucket, extra, key_ok, key_add, is_causal, padded, q.dtype),
                bucket, mods, padded)
            out = _dense.sdpa(
                qb, kb, vb, mask, dropout_p=dropout_p, scale=scale, groups=groups,
                dead_rows=False, sinks=sinks,
            )
            if live is not None:
                out = torch.where(live, out, 0.0)
        outs.append(out.transpose(1, 2).reshape(tiles * s, heads * ev))
    touch = sum(t.flatten()[:0].sum() for t in (q, k, v))  # attached even with no tile
    outs.append(q.new_zeros(s, heads * ev) + touch)
    out = tiled(torch.cat(outs), s).index_select(0, plan.tile_rows)
    out = out.view(batch, padded, heads, ev)
    out = out[:, :length].transpose(1, 2)
    if weights is not None:
        weights = weights.permute(0, 3, 1, 4, 2, 5).reshape(batch, heads, padded, padded)
        weights = weights[:, :, :length, :length]
    return out, weights


def fast_parts(plan: TilePlan) -> tuple[list, list[Bucket]]:
    """The CPU fused path's parts: rectangles of full tiles (one tall call each) and the
    buckets of the other tiles; built once per plan. (A call with a key mask or the causal
    flag changes the full tiles, so it runs on ``plan.buckets``.)"""
    if "parts" not in plan.workspace:
        full, mixed, masks, width = plan.tiles
        n = plan.padded // plan.block
        rects, rest = rectangles(full, n, plan.block, plan.length, plan.padded)
        buckets = plan.buckets if not rects else bucketize(
            plan.batch, plan.length, plan.block, rest, mixed, masks, width)
        plan.workspace["parts"] = (rects, buckets)
    return plan.workspace["parts"]


def _fast(q: Tensor, v: Tensor, explicit: bool, dropout_p: float, key_add: Tensor | None) -> bool:
    """Whether :class:`~mmattn.kernels._block_sparse_cpu.TileAttention` can run the call."""
    return (
        not explicit and dropout_p == 0.0 and q.device.type == "cpu" and q.dtype in DTYPES
        and q.shape[-1] == v.shape[-1] and not exporting()
        and not (key_add is not None and key_add.requires_grad)
    )


def _fused_mask(
    bucket: Bucket, extra: bool, key_ok: Tensor | None, key_add: Tensor | None,
    is_causal: bool, padded: int, dtype: torch.dtype,
) -> tuple[Tensor, Tensor | None]:
    """A bucket's additive mask (dead rows opened) and live rows, for this call."""
    if not extra:
        return bucket.fused_mask(dtype)
    allowed = _call_allowed(bucket, bucket.allowed, key_ok, key_add, is_causal, padded)
    mask, live = additive(allowed, dtype)
    if key_add is not None:
        width = bucket.k_rows.shape[0] // bucket.tiles
        mask = mask + key_add[bucket.k_rows].view(bucket.tiles, 1, 1, width).to(dtype)
    return mask, live


def _key_rows(key_mask: Tensor | None, padded: int) -> tuple[Tensor | None, Tensor | None]:
    """A (b, j) key mask as flat (b padded,) rows: (bool may-attend, float to add)."""
    if key_mask is None:
        return None, None
    length = key_mask.shape[-1]
    if key_mask.dtype == torch.bool:
        return F.pad(key_mask, (0, padded - length), value=False).reshape(-1), None
    add = F.pad(key_mask, (0, padded - length), value=0.0).reshape(-1)
    ok = F.pad(~torch.isneginf(key_mask), (0, padded - length), value=False).reshape(-1)
    return ok, torch.where(ok, add, 0.0)


def _call_allowed(
    bucket: Bucket, allowed: Tensor, key_ok: Tensor | None, key_add: Tensor | None,
    is_causal: bool, padded: int,
) -> Tensor:
    """``bucket.allowed`` with this call's key mask and causal rule."""
    tiles, width = bucket.tiles, bucket.count * (bucket.q_rows.shape[0] // bucket.tiles)
    if key_ok is not None:
        allowed = allowed & key_ok[bucket.k_rows].view(tiles, 1, 1, width)
    if is_causal:
        q_pos = (bucket.q_rows % padded).view(tiles, 1, -1, 1)
        k_pos = (bucket.k_rows % padded).view(tiles, 1, 1, width)
        allowed = allowed & (k_pos <= q_pos)
    return allowed


def _check_modifiers(modifiers: Modifiers | None) -> Modifiers | None:
    """The call's modifiers (None when empty); ALiBi is measured here, on token indices."""
    if modifiers and any(x is not None for x in (modifiers.q_pos, modifiers.k_pos,
                                                 modifiers.bias)):
        raise ValueError("modifiers: the block-sparse kernel measures ALiBi on token indices; "
                         "it takes no q_pos, k_pos or bias")
    return modifiers if modifiers else None


def alibi_term(bucket: Bucket, mods: Modifiers | None, padded: int, dtype: torch.dtype):
    """A bucket's ALiBi term (N, h, s, c s) on each item's token index, or None."""
    if mods is None or mods.slopes is None:
        return None
    return mods.alibi(*((rows % padded).view(bucket.tiles, -1, 1)
                        for rows in (bucket.q_rows, bucket.k_rows)), dtype)


def _with_alibi(parts: tuple, bucket: Bucket, mods: Modifiers | None, padded: int) -> tuple:
    """A bucket's (additive mask, live rows) with the ALiBi term added to the mask."""
    bias = alibi_term(bucket, mods, padded, parts[0].dtype)
    return parts if bias is None else (parts[0] + bias, parts[1])
