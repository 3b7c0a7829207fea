"""The exact attention weights of one kernel call, recomputed tile by tile from its report.

Axis key: ``n`` slots (items of the call, or tiles), ``h`` query heads, ``k`` key heads, ``r``
query rows of a tile, ``j`` key columns of a tile, ``e`` head width, ``E`` edges, ``t``
flat token rows.

Every kernel tells the path listeners (:func:`mmattn.kernels.dense.add_listener`) what it is
about to run: its tensors and facts. A *view* turns one such report into tiles ``(w, q_tok,
k_tok)``: the weights ``w`` (n, h, r, j) of r query rows over j candidate keys, exactly as
the kernel forms them (the same scores, mask and "a row without keys gives zeros" rule), and
the token each row and column is (``-1``: no token — a padded row, an appended
``bias_k``/zero key, an empty slot). A tile holds O(block · keys of a block) numbers, so no
view ever holds an (L, L) tensor. Edge calls give ``(w, q_tok, k_tok)`` per edge instead.

Each query row is in exactly one tile of a call, so the consumer may add tiles up.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

#: At most this many scores in one tile (blocks of rows are cut to fit).
TILE_ELEMENTS = 1 << 22

Tile = tuple[Tensor, Tensor, Tensor]


class Slots:
    """Token ids of (slot, position) coordinates: the items of a padded batch or a bucket.

    Slot ``n`` has queries at token ids ``q_base[n] + i`` for ``i < q_len[n]`` and keys at
    ``k_base[n] + j`` for ``j < k_len[n]``; other positions are no token (-1).
    """

    def __init__(self, q_base: Tensor, q_len: Tensor, k_base: Tensor, k_len: Tensor) -> None:
        self.q_base, self.q_len, self.k_base, self.k_len = q_base, q_len, k_base, k_len

    @staticmethod
    def _ids(base: Tensor, length: Tensor, slot: Tensor, pos: Tensor) -> Tensor:
        base, length = base[slot], length[slot]
        return torch.where((pos >= 0) & (pos < length), base + pos, -1)

    def query(self, slot: Tensor, pos: Tensor) -> Tensor:
        return self._ids(self.q_base, self.q_len, slot, pos)

    def key(self, slot: Tensor, pos: Tensor) -> Tensor:
        return self._ids(self.k_base, self.k_len, slot, pos)


# ---------------------------------------------------------------------- shared pieces


def _acc(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def dot_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """q kᵀ · scale in float32 (float64 for double); k may have fewer heads (grouped queries).

    Shape:
        - q: (n, h, r, e); k: (n, k, j, e); returns (n, h, r, j)
    """
    acc = _acc(q)
    groups = q.shape[1] // max(k.shape[1], 1)
    qg = rearrange(q.to(acc), "n (k g) r e -> n k (g r) e", g=groups)
    scores = torch.matmul(qg, k.to(acc).transpose(-1, -2)) * scale
    return rearrange(scores, "n k (g r) j -> n (k g) r j", g=groups)


def softmax_rows(scores: Tensor, allowed: Tensor | None, bias: Tensor | None) -> Tensor:
    """softmax over the last axis of ``scores + bias`` where ``allowed``; rows without an
    allowed key give zeros (the kernels' one dead-row policy)."""
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    live = ~torch.isneginf(scores).all(dim=-1, keepdim=True)
    weights = torch.softmax(torch.where(live, scores, 0.0), dim=-1)
    return torch.where(live, weights, 0.0)


def split_mask(mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """An SDPA-direction mask as (allowed bool, additive bias), either None, 4-D."""
    if mask is None:
        return None, None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return (mask, None) if mask.dtype == torch.bool else (None, mask)


def _rows(t: Tensor | None, n0: int, n1: int, r0: int, r1: int) -> Tensor | None:
    """The (slots, rows) part of a 4-D mask that may broadcast along either."""
    if t is None:
        return None
    t = t if t.shape[0] == 1 else t[n0:n1]
    return t if t.shape[2] == 1 else t[:, :, r0:r1]


def _rows_per_tile(block: int, heads: int, keys: int, width: int = 1) -> int:
    return max(1, min(block, TILE_ELEMENTS // max(1, heads * keys * width)))


# ---------------------------------------------------------------------- dense


def dense_tiles(
    q: Tensor, k: Tensor, mask: Tensor | None, slots: Slots, *, is_causal: bool = False,
    scale: float | None = None, block: int = 64, score_weight: Tensor | None = None,
) -> Iterator[Tile]:
    """The tiles of ``softmax(q kᵀ · scale + mask)`` (or additive scores) by blocks of rows.

    Shape:
        - q: (n, h, i, e); k: (n, k, j, e); mask broadcastable to (n, h, i, j)
    """
    n_all, heads, length, width = q.shape
    keys = k.shape[2]
    if n_all == 0 or length == 0 or keys == 0:
        return
    if scale is None:
        scale = 1.0 / math.sqrt(width) if width else 1.0
    allowed, bias = split_mask(mask)
    extra = width if score_weight is not None else 1  # additive scores hold (r, j, e)
    rows = _rows_per_tile(block, heads, keys, extra)
    step = max(1, TILE_ELEMENTS // max(1, heads * rows * keys * extra))
    cols = torch.arange(keys, device=q.device)
    for n0 in range(0, n_all, step):
        n1 = min(n_all, n0 + step)
        slot = torch.arange(n0, n1, device=q.device)[:, None]
        k_tok = slots.key(slot, cols[None])
        kn = k[n0:n1]
        for r0 in range(0, length, rows):
            r1 = min(length, r0 + rows)
            qt = q[n0:n1, :, r0:r1]
            if score_weight is None:
                scores = dot_scores(qt, kn, scale)
            else:
                from mmattn.attention.additive import additive_scores

                acc = _acc(qt)
                scores = additive_scores(qt.to(acc), kn.to(acc), score_weight.to(acc))
            ok = _rows(allowed, n0, n1, r0, r1)
            if is_causal:
                causal = cols[None, :] <= torch.arange(r0, r1, device=q.device)[:, None]
                ok = causal if ok is None else ok & causal
            w = softmax_rows(scores, ok, _rows(bias, n0, n1, r0, r1))
            pos = torch.arange(r0, r1, device=q.device)[None]
            yield w, slots.query(slot, pos), k_tok


# ---------------------------------------------------------------------- local band


def band_tiles(
    q: Tensor, k: Tensor, key_mask: Tensor | None, slots: Slots, *, window: int,
    causal: bool, num_global: int, scale: float | None, block: int | None = None,
) -> Iterator[Tile]:
    """The tiles of banded attention: query i sees key j iff |i - j| <= window (j <= i
    when causal) and j is real; the first ``num_global`` tokens see and are seen by all.

    Shape:
        - q: (n, h, l, e); k: (n, k, l, e); key_mask: (n, l) bool (True = real) or float
    """
    n_all, heads, length, width = q.shape
    if n_all == 0 or length == 0:
        return
    if scale is None:
        scale = 1.0 / math.sqrt(width) if width else 1.0
    device = q.device
    window = min(window, length - 1)
    glob = min(num_global, length)
    rows = min(block or max(32, window // 2), length)
    left, right = window, (0 if causal else window)
    span = rows + left + right
    blocks = -(-length // rows)
    pad_k = F.pad(k, (0, 0, left, blocks * rows - length + right))
    slabs = pad_k.unfold(2, span, rows)  # (n, k, blocks, e, span): a view, nothing copied
    keyed = key_mask
    if keyed is None:
        keyed = torch.ones(n_all, length, dtype=torch.bool, device=device)
    fill = False if keyed.dtype == torch.bool else float("-inf")
    pad_m = F.pad(keyed, (left, blocks * rows - length + right), value=fill)
    slab_m = pad_m.unfold(1, span, rows)  # (n, blocks, span)
    per_block = heads * rows * (span + glob)
    step = max(1, TILE_ELEMENTS // max(1, per_block * n_all))
    a = torch.arange(rows, device=device)
    c = torch.arange(span, device=device)
    g = torch.arange(glob, device=device)
    slot = torch.arange(n_all, device=device)[:, None, None]
    for m0 in range(0, blocks, step):
        m1 = min(blocks, m0 + step)
        m = torch.arange(m0, m1, device=device)[:, None]
        q_pos = m * rows + a  # (nb, r)
        k_pos = m * rows - left + c  # (nb, span)
        ks = rearrange(slabs[:, :, m0:m1], "n k b e t -> n k b t e")
        qb = F.pad(q, (0, 0, 0, blocks * rows - length))[:, :, m0 * rows:m1 * rows]
        qb = rearrange(qb, "n h (b r) e -> (n b) h r e", r=rows)
        offset = q_pos[:, :, None] - k_pos[:, None, :]
        ok = (offset.abs() <= window) & (k_pos >= glob)[:, None, :]
        if causal:
            ok &= offset >= 0
        km = slab_m[:, m0:m1]  # (n, nb, span)
        key_cols = ks
        k_all = k_pos.expand(n_all, -1, -1)
        if glob:  # the global keys, after the band (which leaves them out)
            gk = k[:, :, None, :glob].expand(-1, -1, m1 - m0, -1, -1)
            key_cols = torch.cat([ks, gk], dim=3)
            seen = q_pos[:, :, None] >= g if causal else torch.ones(1, 1, glob, dtype=torch.bool,
                                                                     device=device)
            ok = torch.cat([ok, seen.expand(m1 - m0, rows, -1)], dim=2)
            km = torch.cat([km, keyed[:, None, :glob].expand(-1, m1 - m0, -1)], dim=2)
            k_all = torch.cat([k_all, g.expand(n_all, m1 - m0, -1)], dim=2)
        key_cols = rearrange(key_cols, "n k b t e -> (n b) k t e")
        scores = dot_scores(qb, key_cols, scale)  # ((n b), h, r, t)
        ok = rearrange(ok.expand(n_all, -1, -1, -1), "n b r t -> (n b) 1 r t")
        km = rearrange(km, "n b t -> (n b) 1 1 t")
        if km.dtype == torch.bool:
            w = softmax_rows(scores, ok & km, None)
        else:
            w = softmax_rows(scores, ok, km)
        q_row = torch.where(q_pos >= glob, q_pos, -1)  # global rows come below
        q_tok = slots.query(slot, q_row[None].expand(n_all, -1, -1))
        k_tok = slots.key(slot, k_all)
        yield w, rearrange(q_tok, "n b r -> (n b) r"), rearrange(k_tok, "n b t -> (n b) t")
    if glob:  # the global query rows see every key
        cols = torch.arange(length, device=device)
        ok = None if not causal else (cols[None, :] <= g[:, None])[None, None]
        km = rearrange(keyed, "n j -> n 1 1 j")
        if km.dtype == torch.bool:
            ok = km if ok is None else ok & km
            km = None
        yield from dense_tiles_masked(q[:, :, :glob], k, ok, km, slots, scale)


def dense_tiles_masked(
    q: Tensor, k: Tensor, allowed: Tensor | None, bias: Tensor | None, slots: Slots,
    scale: float,
) -> Iterator[Tile]:
    """One tile per slot of a few rows against all keys (the global rows of a band)."""
    for n in range(q.shape[0]):
        scores = dot_scores(q[n:n + 1], k[n:n + 1], scale)
        w = softmax_rows(scores, _rows(allowed, n, n + 1, 0, q.shape[2]),
                         _rows(bias, n, n + 1, 0, q.shape[2]))
        slot = torch.tensor([[n]], device=q.device)
        yield (w, slots.query(slot, torch.arange(q.shape[2], device=q.device)[None]),
               slots.key(slot, torch.arange(k.shape[2], device=q.device)[None]))


# ---------------------------------------------------------------------- neighbourhood


def plan_tiles(
    q: Tensor, k: Tensor, key_mask: Tensor | None, plan, *, scale: float | None,
) -> Iterator[Tile]:
    """The tiles of a neighbourhood plan on flat rows; token ids are the rows.

    Shape:
        - q: (t, h, e); k: (t, k, e); key_mask: (t,) bool or float, or None
    """
    rows, heads, width = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(width) if width else 1.0
    zero = rows
    qz = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
    kz = torch.cat([k, k.new_zeros(1, *k.shape[1:])])
    km = None
    if key_mask is not None:
        fill = False if key_mask.dtype == torch.bool else float("-inf")
        km = torch.cat([key_mask, key_mask.new_full((1,), fill)])
    n, s, t = plan.allowed.shape
    step = max(1, TILE_ELEMENTS // max(1, heads * s * t))
    pick = torch.cat([plan.pick, plan.pick.new_full((1,), -1)])
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        qi = plan.q_index[n0 * s:n1 * s]
        ki = plan.k_index[n0 * t:n1 * t]
        qt = rearrange(qz[qi], "(n s) h e -> n h s e", s=s)
        kt = rearrange(kz[ki], "(n t) k e -> n k t e", t=t)
        ok = plan.allowed[n0:n1][:, None]
        bias = None
        if km is not None:
            kmt = rearrange(km[ki], "(n t) -> n 1 1 t", t=t)
            if kmt.dtype == torch.bool:
                ok = ok & kmt
            else:
                bias = kmt
        w = softmax_rows(dot_scores(qt, kt, scale), ok, bias)
        slot_id = torch.arange(n0 * s, n1 * s, device=q.device)
        picked = (qi < zero) & (pick[qi] == slot_id)
        q_tok = torch.where(picked, qi, -1).view(n1 - n0, s)
        k_tok = torch.where(ki < zero, ki, -1).view(n1 - n0, t)
        yield w, q_tok, k_tok
    if plan.gq_index.numel():  # global rows attend every key of their item
        for b in range(plan.gq_index.shape[0]):
            gq, gk = plan.gq_index[b:b + 1], plan.gk_index[b:b + 1]
            qt = rearrange(qz[gq], "n g h e -> n h g e")
            kt = rearrange(kz[gk], "n j k e -> n k j e")
            ok = plan.gk_valid[b:b + 1][:, None, None]
            bias = None
            if km is not None:
                kmt = rearrange(km[gk], "n j -> n 1 1 j")
                ok, bias = (ok & kmt, None) if kmt.dtype == torch.bool else (ok, kmt)
            w = softmax_rows(dot_scores(qt, kt, scale), ok, bias)
            yield w, torch.where(gq < zero, gq, -1), torch.where(plan.gk_valid[b:b + 1], gk, -1)


# ---------------------------------------------------------------------- edges


def edge_weights(
    q: Tensor, k: Tensor, src: Tensor, dst: Tensor, bias: Tensor | None, scale: float | None,
) -> Tensor:
    """The (E, h) weights of attention along edges: a softmax over each query's edges.

    Shape:
        - q: (t_q, h, e); k: (t_k, k, e); src, dst: (E,); bias: (E, h)
    """
    heads, width = q.shape[1], q.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(width) if width else 1.0
    acc = _acc(q)
    groups = heads // max(k.shape[1], 1)
    step = max(1, TILE_ELEMENTS // max(1, heads * width))
    parts = []
    for e0 in range(0, src.shape[0], step):
        qs = q[dst[e0:e0 + step]].to(acc)
        ks = k[src[e0:e0 + step]].to(acc).repeat_interleave(groups, dim=1)
        parts.append((qs * ks).sum(-1) * scale)
    scores = torch.cat(parts) if parts else q.new_zeros(0, heads, dtype=acc)
    if bias is not None:
        scores = scores + bias.to(acc)
    rows = q.shape[0]
    index = dst[:, None].expand_as(scores)
    peak = scores.new_full((rows, heads), float("-inf")).scatter_reduce(0, index, scores, "amax")
    peak = torch.where(torch.isneginf(peak), 0.0, peak)
    p = torch.exp(scores - peak[dst])
    total = p.new_zeros(rows, heads).index_add_(0, dst, p)
    return p / torch.where(total > 0, total, 1.0)[dst]
