"""Block-sparse attention: only the non-empty (query tile, key tile) pairs are computed.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key heads, ``i``/``j`` query/key length,
``e`` head width, ``s`` tile width, ``n`` tiles per axis, ``N`` query tiles of a bucket,
``c`` key tiles per query tile of a bucket.

The tiles come from a compiled pattern (:class:`mmattn.patterns.SparseMask`): the full
tiles, and the mixed tiles with their exact (s, s) masks. :func:`plan_tiles`
(:mod:`mmattn.kernels._block_sparse_plan`) lays them out once per mask and model width::

    query tiles ─count their key tiles─▶ groups of equal count ─packed.plan─▶ buckets
    bucket: N query tiles x c key tiles each (short rows padded with masked tiles)
        q rows (N s) · k rows (N c s) · allowed (N, 1, s, c s) · live rows

and :func:`attend` runs them on the path :func:`choose_path` picks. ``"cpu-flash"``
(:mod:`mmattn.kernels._block_sparse_cpu`, torch's CPU flash kernel, memory-lean) runs
rectangles of full tiles as tall calls and merges the parts by logsumexp. ``"buckets"``:
one ``index_select`` gathers the query, key and value rows of
every bucket, each bucket is one batched attention call through :mod:`mmattn.kernels.dense`
(``sdpa`` with the additive mask on the fused path; ``attend`` with its explicit twin when
weights are requested or ``MMATTN_FUSED_ATTN=0``), and one ``index_select`` puts the rows
back. Autograd runs backward through the gathers (each becomes one scatter-add).

Rows without any allowed key follow dense.py's one dead-row policy: opened before the
softmax, set to zero after (``live_rows`` / ``open_dead_rows``). Keys that no query may
attend (padding) are zeroed first, so a NaN stored there cannot reach a real output. Query
tiles without any key tile are never computed; their rows are zero.

Score modifiers: ALiBi is an (N, h, s, c s) term per bucket on the token index of the item
(or on ``positions``, where a caller lays rows out in another order: context parallelism),
added to the tile mask; sinks follow the CPU path's logsumexp merge (``TileAttention``), or
else each bucket's call (a query tile's key tiles are all in one bucket); softcap is the
explicit path, tile by tile.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn.kernels import dense as _dense
from mmattn.kernels._block_sparse_cpu import TileAttention, rectangles
from mmattn.kernels._block_sparse_plan import (  # noqa: F401 (the plan's names, re-exported)
    PLAN_ITEMS,
    Bucket,
    TilePlan,
    additive,
    bucketize,
    plan_tiles,
)
from mmattn.kernels._scores import acc_dtype, default_scale
from mmattn.kernels._tiles import Tile, modifiers_of
from mmattn.kernels.modifiers import Modifiers, cpu_flash_ok, with_bias


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
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention over the planned tiles only (unchecked; the layer validates): the path
    :func:`choose_path` picks, :func:`_cpu_flash` or :func:`_buckets`.

    Args:
        q, k, v: head-split queries, keys, values; ``k``/``v`` may have fewer heads
            (grouped-query attention, ``groups`` query heads per key head).
        plan: from ``SparseMask.plan(width)``.
        key_mask: (b, j) bool (True = may attend) or float (added), ANDed with the tiles.
        is_causal: also key j <= query i.
        dropout_p, scale, need_weights: as :func:`mmattn.kernels.dense.attend`.
        modifiers: sinks, softcap and ALiBi (ALiBi on the token index, see the module
            docstring; positions or a term set on the Modifiers are refused).
        positions: (b padded,) int64, the position in its item of each flat row (the rows
            ``b · padded + i``), for ALiBi and ``is_causal``; None: ``i``. A caller that packs
            rows of several places into one sequence (:mod:`mmattn.distributed`'s context
            parallelism) gives their true positions here.

    Shape:
        - q: (b, h, i, e); k: (b, k, i, e); v: (b, k, i, e_v) — self-attention, i = j = L
        - returns: (b, h, i, e_v) and the weights (b, h, i, i) or None
    """
    _check_modifiers(modifiers)
    mods = modifiers if modifiers else None
    scale = default_scale(q, scale)
    explicit = need_weights or not _dense.use_fused_attn() or (mods is not None and mods.explicit)
    call = Call.of(key_mask, is_causal, plan.padded, dropout_p, scale, groups, mods, positions)
    path = choose_path(q, v, explicit, dropout_p, call.key_add)
    if _dense.reporting():
        _dense.report(
            "block-sparse", _dense.explicit_reasons(need_weights, mods), q=q, k=k, v=v,
            mask=None, dropout_p=dropout_p, is_causal=is_causal, scale=scale, key_mask=key_mask,
            density=plan.density, block=plan.block, groups=groups, modifiers=mods, plan=plan,
            runner=path,
        )
    q2, k2, v2 = _flat_rows(q, k, v, plan, call.key_ok)
    if path == "cpu-flash":
        out = _cpu_flash(q2, k2, v2, plan, call, q.shape[1], k.shape[1], q.dtype)
        weights = None
    else:
        out, weights = _buckets(q2, k2, v2, plan, call, q, k.shape[1], explicit, need_weights)
    out = out.view(plan.batch, plan.padded, q.shape[1], v.shape[-1])
    return out[:, :plan.length].transpose(1, 2), weights


def choose_path(q: Tensor, v: Tensor, explicit: bool, dropout_p: float,
                key_add: Tensor | None) -> str:
    """The path of a call: ``"cpu-flash"`` (:class:`~mmattn.kernels._block_sparse_cpu.
    TileAttention`, torch's CPU flash kernel on rectangles and buckets, memory-lean) where it
    can run, else ``"buckets"`` (one batched call of :mod:`mmattn.kernels.dense` a bucket)."""
    cpu_flash = not explicit and q.shape[-1] == v.shape[-1] and cpu_flash_ok(q, key_add,
                                                                             dropout_p)
    return "cpu-flash" if cpu_flash else "buckets"


class Call(NamedTuple):
    """The settings of one call that its path applies to every bucket (:meth:`of`)."""

    key_ok: Tensor | None  # (b padded,) keys that may be attended
    key_add: Tensor | None  # (b padded,) float key mask
    is_causal: bool
    dropout_p: float
    scale: float
    groups: int
    mods: Modifiers | None
    positions: Tensor | None = None  # (b padded,) each flat row's position in its item

    @classmethod
    def of(cls, key_mask: Tensor | None, is_causal: bool, padded: int, dropout_p: float = 0.0,
           scale: float = 1.0, groups: int = 1, mods: Modifiers | None = None,
           positions: Tensor | None = None) -> Call:
        """The settings of a call with this (b, j) key mask, on a plan of ``padded`` rows."""
        return cls(*_key_rows(key_mask, padded), is_causal, dropout_p, scale, groups, mods,
                   positions)

    def at(self, rows: Tensor, padded: int) -> Tensor:
        """The positions in their items of these flat rows (:attr:`positions`, or the
        index ``rows % padded``)."""
        return rows % padded if self.positions is None else self.positions[rows]

    @property
    def extra(self) -> bool:
        """Whether the call changes the tiles' masks (a key mask, the causal rule)."""
        return self.key_ok is not None or self.key_add is not None or self.is_causal


def _flat_rows(q: Tensor, k: Tensor, v: Tensor, plan: TilePlan,
               key_ok: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as flat (b padded, h e) rows; keys no query may attend are zeroed."""
    q2, k2, v2 = _rows(q, plan.padded), _rows(k, plan.padded), _rows(v, plan.padded)
    seen = plan.seen if key_ok is None else plan.seen & key_ok
    if key_ok is not None or not plan.all_seen:
        k2, v2 = torch.where(seen[:, None], k2, 0.0), torch.where(seen[:, None], v2, 0.0)
    return q2, k2, v2


def _cpu_flash(q2: Tensor, k2: Tensor, v2: Tensor, plan: TilePlan, call: Call, heads: int,
               kv_heads: int, dtype: torch.dtype) -> Tensor:
    """The CPU fused path: rectangles of full tiles and the buckets through
    :class:`~mmattn.kernels._block_sparse_cpu.TileAttention`; (b padded, h e_v) rows.
    (ALiBi: every pair has its own term, so no rectangles without a mask.)"""
    mods = call.mods
    alibi = mods is not None and mods.slopes is not None
    rects, buckets = ([], plan.buckets) if call.extra or alibi else fast_parts(plan)
    masks = [_with_alibi(_fused_mask(bk, call, plan.padded, dtype), bk, call, plan.padded)
             for bk in buckets]
    sinks = None if mods is None else mods.sinks
    return TileAttention.apply(q2, k2, v2, sinks, rects, buckets, masks, heads, kv_heads,
                               call.scale, plan.cpu.workspace)


def _buckets(q2: Tensor, k2: Tensor, v2: Tensor, plan: TilePlan, call: Call, q: Tensor,
             kv_heads: int, explicit: bool, need_weights: bool) -> tuple[Tensor, Tensor | None]:
    """One batched :mod:`mmattn.kernels.dense` call a bucket (``sdpa`` with the additive
    mask, or the explicit ``attend``, which can return the weights); (b padded, h e_v) rows
    and the (b, h, i, i) weights or None."""
    batch, heads, length, _ = q.shape
    s, padded, ev = plan.block, plan.padded, v2.shape[1] // kv_heads
    sizes_q = [bk.q_tiles.shape[0] for bk in plan.buckets]
    sizes_k = [bk.k_tiles.shape[0] for bk in plan.buckets]
    qg = tiled(q2, s).index_select(0, plan.q_tiles).split(sizes_q)  # whole tiles: fewer,
    kg = tiled(k2, s).index_select(0, plan.k_tiles).split(sizes_k)  # longer copies
    vg = tiled(v2, s).index_select(0, plan.k_tiles).split(sizes_k)
    outs, weights = [], None
    if need_weights:
        count = padded // s
        weights = q.new_zeros(batch, count, count, heads, s, s, dtype=_dense.weights_dtype(v2))
    for bucket, qb, kb, vb in zip(plan.buckets, qg, kg, vg):
        tiles, width = bucket.tiles, bucket.count * s
        qb = qb.view(tiles, s, heads, -1).transpose(1, 2)
        kb = kb.view(tiles, width, kv_heads, -1).transpose(1, 2)
        vb = vb.view(tiles, width, kv_heads, ev).transpose(1, 2)
        if explicit:
            mask, call_mods = explicit_mask(bucket, call, padded, q.dtype)
            out, w = _dense.attend(
                qb, kb, vb, mask, dropout_p=call.dropout_p, scale=call.scale,
                need_weights=need_weights, report_path=False, groups=call.groups,
                modifiers=call_mods,
            )
            if weights is not None:
                w = w.view(tiles, heads, s, bucket.count, s).permute(0, 3, 1, 2, 4)
                slot = bucket.slots
                weights.index_put_((slot[..., 0], slot[..., 1], slot[..., 2]), w, accumulate=True)
        else:
            mask, live = _with_alibi(_fused_mask(bucket, call, padded, q.dtype), bucket, call,
                                     padded)
            out = _dense.sdpa(
                qb, kb, vb, mask, dropout_p=call.dropout_p, scale=call.scale,
                groups=call.groups, dead_rows=False, sinks=None if call.mods is None
                else call.mods.sinks,
            )
            if live is not None:
                out = torch.where(live, out, 0.0)
        outs.append(out.transpose(1, 2).reshape(tiles * s, heads * ev))
    touch = sum(t.flatten()[:0].sum() for t in (q2, k2, v2))  # attached even with no tile
    outs.append(q2.new_zeros(s, heads * ev) + touch)
    out = tiled(torch.cat(outs), s).index_select(0, plan.tile_rows)
    if weights is not None:
        weights = weights.permute(0, 3, 1, 4, 2, 5).reshape(batch, heads, padded, padded)
        weights = weights[:, :, :length, :length]
    return out, weights


def explicit_mask(bucket: Bucket, call: Call, padded: int,
                  dtype: torch.dtype) -> tuple[Tensor, Modifiers | None]:
    """A bucket's mask on the explicit path (bool, or float with the key mask added) and
    its modifiers with the ALiBi term: what the dense kernel's explicit twin is given."""
    allowed = bucket.allowed
    if call.extra:
        allowed = _call_allowed(bucket, allowed, call, padded)
    mask = with_bias(allowed, _key_term(bucket, call, dtype))
    mods = call.mods
    return mask, (None if mods is None else mods.with_terms(
        alibi_term(bucket, call, padded, dtype)))


def fast_parts(plan: TilePlan) -> tuple[list, list[Bucket]]:
    """The CPU fused path's parts: rectangles of full tiles (one tall call each) and the
    buckets of the other tiles; built once per plan. (A call with a key mask or the causal
    flag changes the full tiles, so it runs on ``plan.buckets``.)"""
    cpu = plan.cpu
    if cpu.parts is None:
        full, mixed, masks, width = cpu.tiles
        n = plan.padded // plan.block
        rects, rest = rectangles(full, n, plan.block, plan.length, plan.padded)
        buckets = plan.buckets if not rects else bucketize(
            plan.batch, plan.length, plan.block, rest, mixed, masks, width)
        cpu.parts = (rects, buckets)
    return cpu.parts


def _fused_mask(bucket: Bucket, call: Call, padded: int,
                dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """A bucket's additive mask (dead rows opened) and live rows, for this call."""
    if not call.extra:
        return bucket.fused_mask(dtype)
    allowed = _call_allowed(bucket, bucket.allowed, call, padded)
    mask, live = additive(allowed, dtype)
    return with_bias(mask, _key_term(bucket, call, dtype)), live


def _key_term(bucket: Bucket, call: Call, dtype: torch.dtype) -> Tensor | None:
    """The call's float key mask on a bucket's key rows, (N, 1, 1, c s); None without."""
    if call.key_add is None:
        return None
    width = bucket.count * bucket.block
    return call.key_add[bucket.k_rows].view(bucket.tiles, 1, 1, width).to(dtype)


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


def _call_allowed(bucket: Bucket, allowed: Tensor, call: Call, padded: int) -> Tensor:
    """``bucket.allowed`` with this call's key mask and causal rule."""
    tiles, width = bucket.tiles, bucket.count * (bucket.q_rows.shape[0] // bucket.tiles)
    if call.key_ok is not None:
        allowed = allowed & call.key_ok[bucket.k_rows].view(tiles, 1, 1, width)
    if call.is_causal:
        q_pos = call.at(bucket.q_rows, padded).view(tiles, 1, -1, 1)
        k_pos = call.at(bucket.k_rows, padded).view(tiles, 1, 1, width)
        allowed = allowed & (k_pos <= q_pos)
    return allowed


def _check_modifiers(modifiers: Modifiers | None) -> None:
    """Raise a ValueError for ALiBi positions or a term: this kernel measures ALiBi on
    token indices."""
    if modifiers and any(x is not None for x in (modifiers.q_pos, modifiers.k_pos,
                                                 modifiers.bias)):
        raise ValueError("modifiers: the block-sparse kernel measures ALiBi on token indices; "
                         "it takes no q_pos, k_pos or bias")


def alibi_term(bucket: Bucket, call: Call, padded: int, dtype: torch.dtype):
    """A bucket's ALiBi term (N, h, s, c s) on each item's token index (the call's
    positions), or None."""
    mods = call.mods
    if mods is None or mods.slopes is None:
        return None
    return mods.alibi(*(call.at(rows, padded).view(bucket.tiles, -1, 1)
                        for rows in (bucket.q_rows, bucket.k_rows)), dtype)


def _with_alibi(parts: tuple, bucket: Bucket, call: Call, padded: int) -> tuple:
    """A bucket's (additive mask, live rows) with the ALiBi term added to the mask."""
    bias = alibi_term(bucket, call, padded, parts[0].dtype)
    return parts if bias is None else (parts[0] + bias, parts[1])


def weight_tiles(record: dict) -> Iterator[Tile]:
    """The tiles of a block-sparse call's report
    (:func:`mmattn.kernels._report_tiles.weight_tiles`): each bucket's query tiles against
    their key tiles, with the mask and ALiBi term of the explicit path
    (:func:`explicit_mask`).

    Shape:
        - record q: (b, h, l, e); k: (b, k, l, e)
    """
    q, k, plan = record["q"], record["k"], record["plan"]
    length, width, padded, s = q.shape[2], q.shape[3], plan.padded, plan.block
    call = Call.of(record.get("key_mask"), bool(record.get("is_causal")), padded,
                   mods=record.get("modifiers"))
    q2, k2 = (_rows(x, padded).view(-1, x.shape[1], width) for x in (q, k))

    def ids(flat: Tensor, tiles: int) -> Tensor:  # padded rows -> b·l + i, -1 past the end
        pos = flat % padded
        return torch.where(pos < length, flat // padded * length + pos, -1).view(tiles, -1)

    for bucket in plan.buckets:
        mask, terms = explicit_mask(bucket, call, padded, acc_dtype(q))
        yield Tile(q2[bucket.q_rows].view(bucket.tiles, s, *q2.shape[1:]).transpose(1, 2),
                   k2[bucket.k_rows].view(bucket.tiles, -1, *k2.shape[1:]).transpose(1, 2),
                   mask, None if terms is None else terms.bias,
                   default_scale(q, record.get("scale")),
                   ids(bucket.q_rows, bucket.tiles), ids(bucket.k_rows, bucket.tiles),
                   mods=modifiers_of(record))
