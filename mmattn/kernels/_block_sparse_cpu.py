"""The CPU fused path of the block-sparse kernel as one ``autograd.Function``.

Axis key: ``h`` query heads, ``k`` key heads, ``e``/``f`` query/value head width, ``s``
tile width, ``N`` query tiles of a bucket, ``j`` key rows, ``r`` flat rows.

A call is split over its key tiles (FlashAttention's split-KV): *rectangles* — a run of
query tiles that share one run of full key tiles (text rows against every other token,
every token against the text) — run as one tall call on slices of the rows, no gather and
no mask; the other tiles run in buckets as in :mod:`mmattn.kernels.block_sparse`. The
parts of a row are merged through their logsumexp, and each part's backward is torch's CPU
flash backward given the merged output and logsumexp, so the gradients are exact.

Nothing gathered is kept for backward: the forward saves the ungathered q, k, v (alive
anyway), the merged output and logsumexp; the backward gathers again into buffers that
live on the plan (a fresh buffer costs page faults that take longer than the copy). Rows
without an allowed key in a bucket are opened in its mask (dense.py's policy), count for
nothing in the merge and get a zero gradient; rows without any key at all come out zero.

Attention sinks (a logit σ_h per head, a key of value zero) cost one step after the merge:
with the row's logsumexp ℓ, ``out · exp(ℓ − ℓ')`` with ``ℓ' = logaddexp(ℓ, σ_h)`` is the
sinked output, and every part's flash backward given ``ℓ'`` and that output is the exact
backward with the sink (the weights it recomputes are the sinked ones), plus
``dσ_h = −Σ_i exp(σ_h − ℓ'_i) · Σ_f dout_if · out_if`` (:mod:`mmattn.kernels.modifiers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from mmattn.kernels.modifiers import FLASH, FLASH_BACKWARD, join_sink, repeat_kv, sink_grad

#: A rectangle is worth a call of its own from this many tiles and query tiles on.
RECT_TILES, RECT_ROWS = 32, 2


@dataclass(eq=False)
class CpuPlan:
    """The CPU fused path's state of one plan (``TilePlan.cpu``): the tiles it cuts
    rectangles from (full tiles, mixed tiles, their masks, the model width), its parts once
    cut (``block_sparse.fast_parts``), and its gather buffers, reused call after call."""

    tiles: tuple
    parts: tuple | None = None
    workspace: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Rect:
    """Flat query rows [q0, q1) against flat key rows [k0, k1), every pair allowed."""

    q0: int
    q1: int
    k0: int
    k1: int


def rectangles(full: Tensor, n: int, s: int, length: int, padded: int) -> tuple[list, Tensor]:
    """Rectangles of full tiles, and the full tiles left for the buckets.

    A query tile's full tiles split into runs of consecutive key tiles; consecutive query
    tiles with the same run make a rectangle, kept when it has ``RECT_ROWS`` query tiles and
    ``RECT_TILES`` tiles or more.
    """
    if full.shape[0] == 0:
        return [], full
    full = full[torch.argsort((full[:, 0] * n + full[:, 1]) * n + full[:, 2])]
    b, qi, kj = full.unbind(1)
    new = torch.ones_like(b, dtype=torch.bool)
    new[1:] = (b[1:] != b[:-1]) | (qi[1:] != qi[:-1]) | (kj[1:] != kj[:-1] + 1)
    run = torch.cumsum(new, 0) - 1
    first = new.nonzero().squeeze(1)
    runs = torch.stack([b[first], kj[first], kj[first] + torch.bincount(run), qi[first]], 1)
    order = torch.argsort(((runs[:, 0] * n + runs[:, 1]) * (n + 1) + runs[:, 2]) * n + runs[:, 3])
    rects, used = [], torch.zeros(runs.shape[0], dtype=torch.bool)
    listed = runs[order].tolist()
    start = 0
    while start < len(listed):
        stop = start + 1
        while (stop < len(listed) and listed[stop][:3] == listed[start][:3]
               and listed[stop][3] == listed[stop - 1][3] + 1):
            stop += 1
        item, k0, k1, q0 = listed[start]
        height = stop - start
        if height >= RECT_ROWS and height * (k1 - k0) >= RECT_TILES:
            base = item * padded
            rects.append(Rect(base + q0 * s, base + min((q0 + height) * s, length),
                              base + k0 * s, base + min(k1 * s, length)))
            used[order[start:stop]] = True
        start = stop
    return rects, full[~used.to(full.device)[run]]


def _gather(tiles: Tensor, x: Tensor, count: int, heads: int, block: int,
            workspace: dict, slot: str) -> Tensor:
    """The (r, heads f) rows of ``tiles`` → (N, heads, len(tiles) s / N, f), into a buffer
    of ``workspace`` reused by the next bucket and call."""
    width = x.shape[1]
    src = x.view(-1, block * width)
    key = (slot, x.dtype, x.device, src.shape[1])
    buf = workspace.get(key)
    if buf is None or buf.shape[0] < tiles.shape[0]:
        buf = workspace[key] = src.new_empty(max(tiles.shape[0], 1), src.shape[1])
    picked = torch.index_select(src, 0, tiles, out=buf[: tiles.shape[0]])
    return picked.view(count, -1, heads, width // heads).transpose(1, 2)


def _heads(x: Tensor, heads: int) -> Tensor:
    """(rows, heads f) → (1, heads, rows, f), a view."""
    return x.view(1, x.shape[0], heads, -1).transpose(1, 2)


def merge_into(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """Merge a partial softmax result of the same rows into ``out`` (.., h, f) and ``lse``
    (.., h), in place."""
    total = torch.logaddexp(lse, part_lse)
    # rows with no key in either part: exp(nan) -> 0 keeps them zero
    old, new = (torch.exp(x - total).nan_to_num_(0.0)[..., None] for x in (lse, part_lse))
    out.mul_(old).add_(part * new)
    lse.copy_(total)


class TileAttention(torch.autograd.Function):
    """``apply(q2, k2, v2, sinks, rects, buckets, masks, heads, kv_heads, scale, workspace)``
    on flat rows q2 (r, h e), k2 (r, k e), v2 (r, k f); returns (r, h f).

    ``masks`` holds one (additive mask with dead rows opened, live rows or None) per bucket
    (an ALiBi term is already in it); ``sinks`` (h,) or None.
    """

    @staticmethod
    def forward(ctx, q2, k2, v2, sinks, rects, buckets, masks, heads, kv_heads, scale,
                workspace):
        groups = heads // kv_heads
        f = v2.shape[1] // kv_heads
        acc = torch.promote_types(q2.dtype, torch.float32)
        out = q2.new_zeros(q2.shape[0], heads, f, dtype=acc)
        lse = torch.full(out.shape[:2], float("-inf"), dtype=acc, device=q2.device)
        s = buckets[0].block if buckets else 1
        tiles_out, tiles_lse = out.view(-1, s, heads, f), lse.view(-1, s, heads)
        for bucket, (mask, live) in zip(buckets, masks):  # each query tile in one bucket
            qb, kb, vb = _gather_bucket(bucket, q2, k2, v2, heads, kv_heads, groups, workspace)
            o, l_ = FLASH(qb, kb, vb, 0.0, False, attn_mask=mask, scale=scale)
            if live is not None:  # rows without a key here are zero and count for nothing
                o, l_ = torch.where(live, o, 0.0), torch.where(live[..., 0], l_, float("-inf"))
            tiles_out.index_copy_(0, bucket.q_tiles, o.transpose(1, 2).to(acc))
            tiles_lse.index_copy_(0, bucket.q_tiles, l_.transpose(1, 2).to(acc))
        for r in rects:  # merged into their rows, which are contiguous
            o, l_ = FLASH(_heads(q2[r.q0:r.q1], heads),
                           *repeat_kv(_heads(k2[r.k0:r.k1], kv_heads),
                                      _heads(v2[r.k0:r.k1], kv_heads), groups),
                           0.0, False, scale=scale)
            merge_into(out[r.q0:r.q1], lse[r.q0:r.q1], o[0].transpose(0, 1), l_[0].T)
        if sinks is not None:  # rows without keys: exp(-inf) = 0, they stay zero
            share, lse = join_sink(lse, sinks)
            out = out * share[..., None]
        out = out.to(q2.dtype)
        ctx.save_for_backward(q2, k2, v2, out, lse, sinks)
        ctx.rects, ctx.buckets, ctx.masks = rects, buckets, masks
        ctx.heads, ctx.kv_heads, ctx.scale, ctx.workspace = heads, kv_heads, scale, workspace
        return out.view(q2.shape[0], -1)

    @staticmethod
    def backward(ctx, grad):
        q2, k2, v2, out, lse, sinks = ctx.saved_tensors
        heads, kv_heads, scale, workspace = ctx.heads, ctx.kv_heads, ctx.scale, ctx.workspace
        groups = heads // kv_heads
        grad = grad.contiguous()
        dsinks = None
        if sinks is not None:  # lse is finite here (logaddexp with σ); dead rows: out = 0
            dsinks = sink_grad(sinks, lse, grad.view(out.shape), out).sum(0).to(sinks.dtype)
        lse = torch.where(torch.isneginf(lse), 0.0, lse).to(torch.promote_types(
            q2.dtype, torch.float32))  # rows without keys: any finite value (their grad is 0)
        out2 = out.view(q2.shape[0], -1)
        dq, dk, dv = torch.zeros_like(q2), torch.zeros_like(k2), torch.zeros_like(v2)
        for r in ctx.rects:
            kr, vr = repeat_kv(_heads(k2[r.k0:r.k1], kv_heads),
                               _heads(v2[r.k0:r.k1], kv_heads), groups)
            gq, gk, gv = FLASH_BACKWARD(
                _heads(grad[r.q0:r.q1], heads), _heads(q2[r.q0:r.q1], heads), kr,
                vr, _heads(out2[r.q0:r.q1], heads), lse[r.q0:r.q1].T[None].contiguous(), 0.0,
                False, scale=scale)
            gk, gv = _fold(gk, kv_heads, groups), _fold(gv, kv_heads, groups)
            dq[r.q0:r.q1] += gq[0].transpose(0, 1).reshape(r.q1 - r.q0, -1)
            dk[r.k0:r.k1] += gk[0].transpose(0, 1).reshape(r.k1 - r.k0, -1)
            dv[r.k0:r.k1] += gv[0].transpose(0, 1).reshape(r.k1 - r.k0, -1)
        for bucket, (mask, live) in zip(ctx.buckets, ctx.masks):
            block, tiles, t = bucket.block, bucket.tiles, bucket.q_tiles
            qb, kb, vb = _gather_bucket(bucket, q2, k2, v2, heads, kv_heads, groups, workspace)
            gb = _gather(t, grad, tiles, heads, block, workspace, "grad")
            if live is not None:
                gb = torch.where(live, gb, 0.0)
            ob = _gather(t, out2, tiles, heads, block, workspace, "out")
            lb = lse.view(-1, block, heads)[t].transpose(1, 2).contiguous()
            gq, gk, gv = FLASH_BACKWARD(gb, qb, kb, vb, ob, lb, 0.0, False,
                                         attn_mask=mask, scale=scale)
            gk, gv = _fold(gk, kv_heads, groups), _fold(gv, kv_heads, groups)
            _scatter(dq, t, gq, block)
            _scatter(dk, bucket.k_tiles, gk, block)
            _scatter(dv, bucket.k_tiles, gv, block)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None


def _scatter(target: Tensor, tiles: Tensor, x: Tensor, block: int) -> None:
    """Add (N, heads, j, f) into the rows of ``tiles`` of (r, heads f)."""
    rows = x.transpose(1, 2).reshape(-1, block * target.shape[1])
    target.view(-1, block * target.shape[1]).index_add_(0, tiles, rows)


def _fold(g: Tensor, kv_heads: int, groups: int) -> Tensor:
    """Sum the gradients of the g query heads that share a key head."""
    return g if groups == 1 else g.unflatten(1, (kv_heads, groups)).sum(2)


def _gather_bucket(bucket, q2, k2, v2, heads, kv_heads, groups, workspace):
    tiles, block = bucket.tiles, bucket.block
    qb = _gather(bucket.q_tiles, q2, tiles, heads, block, workspace, "q")
    kb = _gather(bucket.k_tiles, k2, tiles, kv_heads, block, workspace, "k")
    vb = _gather(bucket.k_tiles, v2, tiles, kv_heads, block, workspace, "v")
    return (qb, *repeat_kv(kb, vb, groups))
