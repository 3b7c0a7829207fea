"""The running top keys of one attention call, fed kernel report by kernel report.

Axis key: ``b`` items, ``h`` heads, ``l`` positions, ``t`` flat tokens, ``n`` slots of a
tile, ``r`` its query rows, ``j`` its key columns, ``k`` top keys, ``E`` edges.

Each kernel report of the call (:func:`mmattn.kernels.dense.add_listener`) becomes the
tiles the kernel runs (:mod:`._mass_views`): their weights come from the kernels' own
explicit path, and only the k best keys of each row are kept.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mmattn.debug import _mass_views as views
from mmattn.debug._mass_groups import Layout
from mmattn.debug._mass_terms import neighborhood_terms
from mmattn.debug._mass_views import Unsupported

__all__ = ["Tally", "Unsupported"]


class Tally:
    """The running top keys of one call, fed tile by tile."""

    def __init__(self, layout: Layout, topk: int) -> None:
        self.layout, self.topk = layout, topk
        self.top: tuple[Tensor, Tensor] | None = None  # (b, h, l, k) weights and indices

    def _start(self, heads: int, like: Tensor) -> None:
        if self.top is None:
            shape = (self.layout.batch, heads, self.layout.length, self.topk)
            self.top = (torch.zeros(shape, device=like.device),
                        torch.full(shape, -1, dtype=torch.long, device=like.device))
        if self.top[0].shape[1] != heads:
            raise Unsupported(f"the call's kernels disagree on heads ({self.top[0].shape[1]}, "
                              f"{heads})")

    def feed(self, record: dict, block: int | None) -> None:
        """Add a kernel report of the call: its tiles (or edges) of query rows."""
        kind, tiles = self._tiles(record, block)
        for tile in tiles:
            if kind == "edges":
                self.edges(*tile)
            else:
                self.rows(tile)

    def _slots(self, record: dict, q: Tensor) -> views.Slots:
        layout = self.layout
        starts, lengths = layout.offsets[:-1], layout.lengths
        if "items" in record:  # a packed bucket: slot n is item items[n]
            items = torch.tensor(record["items"], dtype=torch.long, device=starts.device)
            starts, lengths = starts[items], lengths[items]
        elif q.shape[0] != layout.batch or q.shape[2] != layout.length:
            raise Unsupported(f"a kernel call of shape {tuple(q.shape)} on tokens "
                              f"{(layout.batch, layout.length)}")
        return views.Slots(starts, lengths, starts, lengths)

    def _tiles(self, record: dict, block: int | None) -> tuple[str, Iterator]:
        path = record["path"]
        q, k = record.get("q"), record.get("k")
        if path == "local":  # its blocks and slabs; "inputs" are the tensors before blocking
            if "inputs" not in record:  # an empty sequence or batch: nothing attended
                return "rows", iter(())
            slots = self._slots(record, record["inputs"][0])
            return "rows", views.band_tiles(record, slots)
        if (record.get("modifiers") or record.get("position_bias") is not None) and (
            path not in ("local", "fused", "explicit", "chunked", "packed", "neighborhood",
                         "block-sparse", "edge", "edge-explicit")
        ):
            raise Unsupported(f"score modifiers on the {path!r} kernel are not applied by "
                              "attention_mass")
        if path == "neighborhood":
            return "rows", self._neighborhood(record)
        if path == "block-sparse" and "plan" in record:
            layout = self.layout
            if not torch.equal(layout.offsets.cpu(),
                               torch.arange(layout.batch + 1) * layout.length):
                raise Unsupported("a block-sparse call on packed tokens")
            return "rows", views.sparse_tiles(record)
        if path in ("edge", "edge-explicit") and "src" in record:
            w = views.edge_weights(q, k, record["src"], record["dst"], record.get("bias"),
                                   record.get("scale"), **views.modifiers_of(record))
            return "edges", iter([(w, record["dst"], record["src"])])
        if path == "packed" and record.get("kernel") == "jagged-sdpa":
            return "rows", self._jagged(record, block)
        if path in ("fused", "explicit", "chunked") or (
            path == "packed" and record.get("kernel") == "buckets"
        ):
            return "rows", views.dense_tiles(
                q, k, record.get("mask"), self._slots(record, q),
                is_causal=bool(record.get("is_causal")), scale=record.get("scale"),
                block=block or 64, score_weight=record.get("score_weight"),
                **views.modifiers_of(record),
            )
        raise Unsupported(f"the {path!r} kernel path is not known to attention_mass")

    def _neighborhood(self, record: dict) -> Iterator:
        from mmattn.kernels.neighborhood import build_plan, choose_tiles, padded_items

        q, k, key_mask = record["q"], record["k"], record.get("mask")
        plan, items = record.get("plan"), record.get("items")
        if plan is None:  # the padded form: a plan over every item of the batch
            batch, _, length, _ = q.shape
            kernel, dilation = tuple(record["kernel_size"]), tuple(record["dilation"])
            items = padded_items(batch, length, record["grid"],
                                 num_global_tokens=record["num_global_tokens"],
                                 grid_start=record["grid_start"])
            tiles = choose_tiles(items, kernel, dilation)
            plan = build_plan(batch * length, items, kernel, dilation, tiles, q.device)
            q, k = (rearrange(t, "b h l e -> (b l) h e") for t in (q, k))
            key_mask = None if key_mask is None else key_mask.reshape(-1)
        return views.plan_tiles(q, k, key_mask, plan, scale=record.get("scale"),
                                **neighborhood_terms(record, items, q.shape[0], q))

    def _jagged(self, record: dict, block: int | None) -> Iterator:
        starts, lengths = self.layout.offsets[:-1], self.layout.lengths
        for m, (qm, km) in enumerate(zip(record["q"].unbind(), record["k"].unbind())):
            slots = views.Slots(starts[m:m + 1], lengths[m:m + 1], starts[m:m + 1],
                                lengths[m:m + 1])
            yield from views.dense_tiles(qm[None], km[None], None, slots,
                                         is_causal=bool(record.get("is_causal")),
                                         block=block or 64)

    def rows(self, tile: views.Tile) -> None:
        """Add a tile (:class:`~mmattn.debug._mass_views.Tile`) of query rows."""
        self._start(tile.q.shape[1], tile.q)
        for part in views.chunks(tile, TOP_ELEMENTS):
            self._top_rows(views.weights(part), part.q_tok, part.k_tok)

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
        self._start(w.shape[1], w)
        if not w.numel():
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


#: Scores per step of the top keys (small enough to stay in the CPU's cache).
TOP_ELEMENTS = 1 << 17


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
