"""The CPU fused path of the block-sparse kernel as one ``autograd.Function``.

Axis key: ``h`` query heads, ``k`` key heads, ``e``/``f`` query/value head width, ``s``
tile width, ``N`` query tiles of a bucket, ``j`` its key rows (c s), ``r`` flat rows.

What autograd would keep for the generic path — every bucket's gathered queries, keys and
values — is not kept: the forward saves only the ungathered q, k, v (alive anyway), each
bucket's output and logsumexp; the backward gathers again (one ``index_select`` each) and
calls torch's CPU flash-attention backward per bucket. Query rows are written once
(``index_copy_``), key and value gradients added up (``index_add_``). Rows without an
allowed key are opened in the mask (dense.py's policy), zeroed in the output and given a
zero gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

#: Dtypes torch's CPU flash kernel takes.
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _gather(tiles: Tensor, x: Tensor, count: int, heads: int, block: int,
            workspace: dict | None = None, slot: str = "") -> Tensor:
    """The (r, heads f) rows of ``tiles`` → (N, heads, len(tiles) s / N, f).

    With a ``workspace`` the rows land in a buffer kept there for the next bucket and call
    (a fresh buffer of this size costs page faults that take longer than the copy).
    """
    width = x.shape[1]
    src = x.view(-1, block * width)
    if workspace is None:
        picked = src.index_select(0, tiles)
    else:
        key = (slot, x.dtype, x.device, src.shape[1])
        buf = workspace.get(key)
        if buf is None or buf.shape[0] < tiles.shape[0]:
            buf = workspace[key] = src.new_empty(max(tiles.shape[0], 1), src.shape[1])
        picked = torch.index_select(src, 0, tiles, out=buf[: tiles.shape[0]])
    return picked.view(count, -1, heads, width // heads).transpose(1, 2)


def _scatter(target: Tensor, tiles: Tensor, x: Tensor, block: int, add: bool) -> None:
    """Write (or add) (N, heads, j, f) into the rows of ``tiles`` of (r, heads f)."""
    rows = x.transpose(1, 2).reshape(-1, block * target.shape[1])
    view = target.view(-1, block * target.shape[1])
    if add:
        view.index_add_(0, tiles, rows)
    else:
        view.index_copy_(0, tiles, rows)


class TileAttention(torch.autograd.Function):
    """Block-sparse attention over flat rows: ``apply(q2, k2, v2, buckets, masks, heads,
    kv_heads, scale, workspace)`` with q2 (r, h e), k2 (r, k e), v2 (r, k f); returns
    (r, h f).

    ``masks`` holds one (additive mask with dead rows opened, live rows or None) per bucket;
    ``workspace`` (a dict, or None) keeps the gather buffers between buckets and calls: a
    plan's own, so one model's calls reuse them one after the other.
    """

    @staticmethod
    def forward(ctx, q2, k2, v2, buckets, masks, heads, kv_heads, scale, workspace):
        groups = heads // kv_heads
        out = q2.new_zeros(q2.shape[0], heads * (v2.shape[1] // kv_heads))
        saved = []
        for bucket, (mask, live) in zip(buckets, masks):
            qb, kb, vb = _gather_bucket(bucket, q2, k2, v2, heads, kv_heads, groups, workspace)
            o, lse = _FLASH(qb, kb, vb, 0.0, False, attn_mask=mask, scale=scale)
            saved.append((o, lse))
            if live is not None:
                o = torch.where(live, o, 0.0)
            _scatter(out, bucket.q_tiles, o, bucket.block, add=False)
        ctx.save_for_backward(q2, k2, v2)
        ctx.buckets, ctx.masks, ctx.outputs = buckets, masks, saved
        ctx.heads, ctx.kv_heads, ctx.scale, ctx.workspace = heads, kv_heads, scale, workspace
        return out

    @staticmethod
    def backward(ctx, grad):
        q2, k2, v2 = ctx.saved_tensors
        heads, kv_heads, scale, workspace = ctx.heads, ctx.kv_heads, ctx.scale, ctx.workspace
        groups = heads // kv_heads
        dq, dk, dv = torch.zeros_like(q2), torch.zeros_like(k2), torch.zeros_like(v2)
        for bucket, (mask, live), (o, lse) in zip(ctx.buckets, ctx.masks, ctx.outputs):
            qb, kb, vb = _gather_bucket(bucket, q2, k2, v2, heads, kv_heads, groups, workspace)
            gb = _gather(bucket.q_tiles, grad.contiguous(), bucket.tiles, heads, bucket.block)
            if live is not None:
                gb = torch.where(live, gb, 0.0)
            gq, gk, gv = _FLASH_BACKWARD(gb.contiguous(), qb, kb, vb, o, lse, 0.0, False,
                                         attn_mask=mask, scale=scale)
            if groups > 1:  # the g query heads of a key head share its gradient
                gk = gk.unflatten(1, (kv_heads, groups)).sum(2)
                gv = gv.unflatten(1, (kv_heads, groups)).sum(2)
            _scatter(dq, bucket.q_tiles, gq, bucket.block, add=False)
            _scatter(dk, bucket.k_tiles, gk, bucket.block, add=True)
            _scatter(dv, bucket.k_tiles, gv, bucket.block, add=True)
        ctx.outputs = None
        return dq, dk, dv, None, None, None, None, None, None


def _gather_bucket(bucket, q2, k2, v2, heads, kv_heads, groups, workspace):
    tiles, block = bucket.tiles, bucket.block
    qb = _gather(bucket.q_tiles, q2, tiles, heads, block, workspace, "q")
    kb = _gather(bucket.k_tiles, k2, tiles, kv_heads, block, workspace, "k")
    vb = _gather(bucket.k_tiles, v2, tiles, kv_heads, block, workspace, "v")
    if groups > 1:  # torch's CPU flash kernel has no grouped heads: repeat per bucket
        kb, vb = kb.repeat_interleave(groups, dim=1), vb.repeat_interleave(groups, dim=1)
    return qb, kb, vb
