"""Per-group weight sums and running top keys of one attention call, fed tile by tile.

Axis key: ``b`` items, ``h`` heads, ``l`` positions, ``t`` flat tokens, ``n`` slots of a
tile, ``r`` its query rows, ``j`` its key columns, ``G`` groups (one more, the last, for
"no group": padding, appended keys), ``k`` top keys, ``E`` edges.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mmattn.debug import _mass_views as views
from mmattn.debug._mass_groups import Layout
from mmattn.kernels import dense as _kernel


class Unsupported(Exception):
    """A report this module cannot turn into weights (the call is then skipped)."""


class Tally:
    """Per-group weight sums and the top keys of one call, fed tile by tile."""

    def __init__(self, layout: Layout, group: Tensor | None, num_groups: int, topk: int | None):
        self.layout, self.num_groups, self.topk = layout, num_groups, topk
        none = num_groups
        if group is None:
            group = torch.full_like(layout.pos, -1)
        self.k_group = torch.where(group >= 0, group, none)
        self.q_group = torch.where((group >= 0) & layout.real, group, none)
        self.sums: Tensor | None = None  # (h, G + 1, G + 1) float64
        self.top: tuple[Tensor, Tensor] | None = None  # (b, h, l, k) weights and indices

    def counts(self) -> Tensor:
        """(G,) real query tokens of every group."""
        return torch.bincount(self.q_group, minlength=self.num_groups + 1)[: self.num_groups]

    def _start(self, heads: int, like: Tensor) -> None:
        groups = self.num_groups + 1
        if self.sums is None:
            self.sums = torch.zeros(heads, groups, groups, dtype=torch.float64, device=like.device)
        if self.topk and self.top is None:
            shape = (self.layout.batch, heads, self.layout.length, self.topk)
            self.top = (torch.zeros(shape, device=like.device),
                        torch.full(shape, -1, dtype=torch.long, device=like.device))
        if self.sums.shape[0] != heads:
            raise Unsupported(f"the call's kernels disagree on heads ({self.sums.shape[0]}, "
                              f"{heads})")

    def rows(self, tile: views.Tile) -> None:
        """Add a tile (:class:`~mmattn.debug._mass_views.Tile`) of query rows."""
        heads, groups = tile.q.shape[1], self.num_groups + 1
        self._start(heads, tile.q)
        q_tok, k_tok = tile.q_tok, tile.k_tok
        k_group = torch.where(k_tok >= 0, self.k_group[k_tok.clamp(min=0)], groups - 1)
        q_group = torch.where(q_tok >= 0, self.q_group[q_tok.clamp(min=0)], groups - 1)
        if self.topk or tile.score_weight is not None or tile.softcap is not None:
            per_row = []
            for part, kg in zip(views.chunks(tile, SUM_ELEMENTS),
                                views.split_slots(k_group, tile, SUM_ELEMENTS)):
                w = views.weights(part)
                onehot = F.one_hot(kg, groups).to(w.dtype)[:, None]  # (n, 1, j, G + 1)
                per_row.append(torch.matmul(w, onehot))
                if self.topk:
                    self._top_rows(w, part.q_tok, part.k_tok)
            per_row = torch.cat(per_row)
        else:
            per_row = _tile_sums(tile, k_group, groups)
        per_row = rearrange(per_row, "n h r g -> h (n r) g")
        self.sums.index_add_(1, q_group.reshape(-1), per_row.double())

    def _top_rows(self, w: Tensor, q_tok: Tensor, k_tok: Tensor) -> None:
        """Keep the k best keys of every row: weight first, then the lower key index."""
        k = min(self.topk, w.shape[-1])
        key = torch.where((k_tok >= 0)[:, None, None, :] & (w > 0), w, -1.0)
        if not _ascending(k_tok):  # ties go to the lower index: columns in index order
            order = k_tok.argsort(dim=-1, stable=True)
            k_tok = k_tok.gather(-1, order)
            key = key.gather(-1, order[:, None, None, :].expand_as(key))
        values, at = _best(key, k)
        ids = k_tok[:, None, None, :].expand_as(key).gather(-1, at)
        keep = values > 0
        index = torch.where(keep, self.layout.pos[ids.clamp(min=0)], -1)
        values = torch.where(keep, values, 0.0)
        if k < self.topk:
            extra = self.topk - k
            values, index = F.pad(values, (0, extra)), F.pad(index, (0, extra), value=-1)
        real = (q_tok >= 0) & self.layout.real[q_tok.clamp(min=0)]
        rows = q_tok[real]
        b, i = self.layout.item[rows], self.layout.pos[rows]
        top_w, top_i = self.top
        top_w[b, :, i] = rearrange(values, "n h r k -> n r h k")[real].to(top_w.dtype)
        top_i[b, :, i] = rearrange(index, "n h r k -> n r h k")[real]

    def edges(self, w: Tensor, q_tok: Tensor, k_tok: Tensor) -> None:
        """Add edge weights: w (E, h), q_tok / k_tok (E,) the query and key token of each."""
        heads, groups = w.shape[1], self.num_groups + 1
        self._start(heads, w)
        cell = self.q_group[q_tok] * groups + self.k_group[k_tok]
        self.sums.view(heads, -1).index_add_(1, cell, w.t().double())
        if self.top is None or not w.numel():
            return
        order = k_tok.argsort(stable=True)  # sort by (query, weight desc, key) per head
        w, q_tok, k_tok = w[order], q_tok[order], k_tok[order]
        by_w = w.sort(dim=0, descending=True, stable=True).indices  # (E, h)
        by_q = q_tok[by_w].sort(dim=0, stable=True).indices
        at = by_w.gather(0, by_q)
        wq, qq, kq = w.gather(0, at), q_tok[at], k_tok[at]
        steps = torch.arange(wq.shape[0], device=w.device)[:, None].expand_as(qq)
        start = torch.ones_like(qq, dtype=torch.bool)
        start[1:] = qq[1:] != qq[:-1]
        rank = steps - torch.where(start, steps, 0).cummax(dim=0).values
        keep = (rank < self.topk) & (wq > 0) & self.layout.real[qq]
        edge, head = keep.nonzero(as_tuple=True)
        rows = qq[edge, head]
        top_w, top_i = self.top
        b, i, r = self.layout.item[rows], self.layout.pos[rows], rank[edge, head]
        top_w[b, head, i, r] = wq[edge, head].to(top_w.dtype)
        top_i[b, head, i, r] = self.layout.pos[kq[edge, head]]


def _tile_sums(tile: views.Tile, k_group: Tensor, groups: int) -> Tensor:
    """(n, h, r, G + 1) the weight each row of a tile gives to each key group.

    A row's weights over its allowed keys sum to 1 (0 for a dead row), so where every key a
    slot's rows may attend is of one group, that group gets all of it and no score is
    needed; only the slots whose allowed keys mix groups are computed
    (:func:`_group_sums`). In a fused sequence that is the few tiles at a border.
    """
    n, heads, rows, _ = tile.q.shape
    if tile.sinks is not None:  # the sink takes a share of every row: score them all
        return _group_sums(tile, k_group, groups)
    allowed, bias = tile.allowed, tile.bias
    ok = torch.ones(n, 1, 1, k_group.shape[1], dtype=torch.bool, device=k_group.device)
    if allowed is not None:
        ok = ok & allowed
    if bias is not None:
        ok = ok & ~torch.isneginf(bias)
    live = ok.any(dim=-1)  # (n, h | 1, r | 1)
    cols = ok.flatten(1, 2).any(dim=1)  # (n, j): a key some row of the slot may attend
    low = torch.where(cols, k_group, groups).amin(dim=-1)
    high = torch.where(cols, k_group, -1).amax(dim=-1)
    single = (low == high) | ~cols.any(dim=-1)
    sums = torch.zeros(n, heads, rows, groups, device=k_group.device,
                       dtype=torch.promote_types(tile.q.dtype, torch.float32))
    one = F.one_hot(low.clamp(max=groups - 1), groups).to(sums.dtype)[:, None, None]
    sums += live.expand(n, heads, rows)[..., None] * one
    mixed = (~single).nonzero().flatten()
    if mixed.numel() == n:  # every slot: no copy of the tile
        return _flash_sums(tile, k_group, groups)
    if mixed.numel():
        part = tile._replace(
            q=tile.q[mixed], k=tile.k[mixed],
            allowed=None if allowed is None else _slots_of(allowed, mixed),
            bias=None if bias is None else _slots_of(bias, mixed),
        )
        sums[mixed] = _flash_sums(part, k_group[mixed], groups)
    return sums


def _flash_sums(tile: views.Tile, k_group: Tensor, groups: int) -> Tensor:
    """:func:`_group_sums` through SDPA: the keys' one-hot groups as values (padded to the
    head width, which the CPU flash kernel needs); rows without keys give zeros."""
    q, k = tile.q, tile.k
    width = q.shape[-1]
    if groups > width or q.dtype != torch.float32 or tile.sinks is not None:
        return _group_sums(tile, k_group, groups)
    values = F.pad(F.one_hot(k_group, groups).to(q.dtype), (0, width - groups))
    values = values[:, None].expand(-1, k.shape[1], -1, -1)
    mask = tile.allowed
    if tile.bias is not None:
        bias = tile.bias.to(q.dtype)
        mask = bias if mask is None else bias.masked_fill(~mask, -math.inf)
    out = _kernel.sdpa(q, k, values, mask, scale=tile.scale,
                       groups=q.shape[1] // max(k.shape[1], 1))
    return out[..., :groups].float()


def _slots_of(t: Tensor, index: Tensor) -> Tensor:
    return t if t.shape[0] == 1 else t[index]


#: Scores per step of :func:`_group_sums` (small enough to stay in the CPU's cache).
SUM_ELEMENTS = 1 << 17


def _best(key: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest of every row, best first, ties to the lower column (columns in index
    order): k passes of ``max`` (which returns the first maximum) for small k, else topk
    with the ties at the k-th value settled by column."""
    if k <= 16:
        key = key.clone()
        values, at = [], []
        for _ in range(k):
            value, index = key.max(dim=-1, keepdim=True)
            values.append(value)
            at.append(index)
            key.scatter_(-1, index, -2.0)  # below every weight and every "no key" (-1)
        return torch.cat(values, dim=-1), torch.cat(at, dim=-1)
    kth = key.topk(k, dim=-1).values[..., -1:]
    above, tied = key > kth, key == kth
    need = k - above.sum(dim=-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(dim=-1) <= need))  # exactly k a row
    at = chosen.nonzero(as_tuple=True)[-1].view(*key.shape[:-1], k)  # ascending
    values, order = key.gather(-1, at).sort(dim=-1, descending=True, stable=True)
    return values, at.gather(-1, order)


def _ascending(k_tok: Tensor) -> bool:
    """Whether the real key columns of every slot come in increasing token order."""
    ids = torch.where(k_tok >= 0, k_tok, -1)
    return bool(((ids >= ids.cummax(dim=-1).values) | (ids < 0)).all())


def _group_sums(tile: views.Tile, k_group: Tensor, groups: int) -> Tensor:
    """(n, h, r, G + 1) the weight each row gives to each key group: the softmax of each
    step's scores, in place, times the keys' one-hot groups; dead rows give zeros."""
    q, k = tile.q, tile.k
    n, heads, rows, _ = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    kv_heads, keys = k.shape[1], k.shape[2]
    g = heads // max(kv_heads, 1)
    onehot = F.one_hot(k_group, groups).to(acc)[:, None]  # (n, 1, j, G + 1)
    allowed, bias = tile.allowed, tile.bias
    live = None
    if allowed is not None:
        live = allowed.any(dim=-1, keepdim=True)
    if bias is not None:
        seen = ~torch.isneginf(bias).all(dim=-1, keepdim=True)
        live = seen if live is None else live & seen
    qs = rearrange(q.to(acc) * tile.scale, "n (k g) r e -> n k (g r) e", g=g)
    step = max(1, SUM_ELEMENTS // max(1, heads * rows * keys))
    out = []
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        scores = torch.matmul(qs[n0:n1], k[n0:n1].to(acc).transpose(-1, -2))
        scores = rearrange(scores, "n k (g r) j -> n (k g) r j", g=g)
        add = None if bias is None else views._part(bias, n0, n1).to(acc)
        if allowed is not None:  # a small additive mask: adding beats masked_fill_ here
            ok = views._part(allowed, n0, n1)
            blocked = torch.zeros(ok.shape, dtype=acc, device=q.device).masked_fill_(
                ~ok, -math.inf)
            add = blocked if add is None else add + blocked
        if add is not None:
            scores.add_(add)
        if tile.sinks is None:
            torch._softmax(scores, -1, False, out=scores)
        else:
            views.softmax_rows(scores, None, None, tile.sinks)
        sums = torch.matmul(scores, onehot[n0:n1])
        if live is not None and bias is not None and allowed is not None:
            sums = torch.where(~torch.isneginf(add).all(dim=-1, keepdim=True), sums, 0.0)
        out.append(sums)
    sums = torch.cat(out)
    return sums if live is None else torch.where(live, sums, 0.0)
