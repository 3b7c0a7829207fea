"""Which token is which in an attention call (:class:`Layout`), and the running top keys
of the call (:class:`Tally`), fed kernel report by kernel report: the kernel that made a
report gives the weights of its tiles (:func:`mmattn.kernels._report_tiles.weight_tiles`);
its rows are mapped to tokens and the k best keys of each row kept.

Axis key: ``b`` items, ``h`` heads, ``l`` positions, ``t`` flat tokens, ``n`` slots of a
tile, ``r`` its query rows, ``j`` its key columns, ``k`` top keys, ``E`` edges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from mmattn._jagged import contiguous_parts, owners
from mmattn.kernels._report_tiles import call_tensors, weight_tiles
from mmattn.kernels._tiles import Unsupported
from mmattn.tokens import Tokens

__all__ = ["Layout", "Tally"]

#: Scores per step of the top keys (small enough to stay in the CPU's cache).
TOP_ELEMENTS = 1 << 17


@dataclass
class Layout:
    """The tokens of one attention call as flat ids.

    Attributes:
        batch, length: items, and their (longest) length.
        offsets: (b + 1,) start of each item's ids (``b·L`` padded).
        real: (t,) True for a real token (not padding).
        item, pos: (t,) the item and the position inside it of each id.
        flat: the ids are packed rows (else ``b·L + l``).
    """

    batch: int
    length: int
    offsets: Tensor
    real: Tensor
    item: Tensor
    pos: Tensor
    flat: bool = False

    @staticmethod
    def make(offsets: Tensor, real: Tensor | None = None, length: int | None = None) -> Layout:
        """From the items' offsets (b + 1,): packed rows, or ``b·L`` given ``length`` L."""
        total, lengths = int(offsets[-1]), offsets.diff()
        item = owners(offsets, total)
        pos = torch.arange(total, device=offsets.device) - offsets[:-1][item]
        if real is None:
            real = torch.ones(total, dtype=torch.bool, device=offsets.device)
        longest = int(lengths.max()) if lengths.numel() else 0
        return Layout(len(offsets) - 1, longest if length is None else length, offsets,
                      real.reshape(-1).to(offsets.device), item, pos, length is None)

    def fits(self, tokens: Tokens) -> bool:
        """Whether a call of this layout runs on ``tokens`` (a packed call: the same items;
        a padded one: the same (B, L), packed Tokens a block unpacks included)."""
        if (self.batch, self.length) != (tokens.batch_size, tokens.length):
            return False
        return not self.flat or (tokens.is_packed and torch.equal(
            self.offsets.cpu(), contiguous_parts(tokens.x)[1].cpu()))

    def rows(self, x: Tensor, items: list[int] | None = None) -> Tensor:
        """The token of every row of a kernel's tensor (-1: none): (n, h, l, e) gives (n·l,)
        (slot n is item ``items[n]``, default n; positions past the item's length, such as
        appended keys, are none); rows (t, h, e) are the tokens themselves."""
        if x.dim() == 3:
            if x.shape[0] != self.real.shape[0]:
                raise Unsupported(f"a kernel call on {x.shape[0]} rows for "
                                  f"{self.real.shape[0]} tokens")
            return torch.arange(x.shape[0], device=self.real.device)
        starts, lengths = self.offsets[:-1], self.offsets.diff()
        if items is not None:
            index = torch.tensor(items, dtype=torch.long, device=starts.device)
            starts, lengths = starts[index], lengths[index]
        elif x.shape[0] != self.batch or x.shape[2] < self.length:
            raise Unsupported(f"a kernel call of shape {tuple(x.shape)} on tokens "
                              f"{(self.batch, self.length)}")
        pos = torch.arange(x.shape[2], device=starts.device)
        return torch.where(pos < lengths[:, None], starts[:, None] + pos, -1).reshape(-1)


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
        """Add a kernel report of the call: the weights of its tiles (or edges)."""
        frame = call_tensors(record)  # a batch's rows map to tokens; flat rows are tokens
        tokens = [None if x.is_nested or x.dim() != 4 else
                  self.layout.rows(x, record.get("items")) for x in frame]
        for q_ids, k_ids, w in weight_tiles(record, block or 64, TOP_ELEMENTS):
            q_tok, k_tok = (ids if at is None else torch.where(ids >= 0, at[ids.clamp(min=0)], -1)
                            for at, ids in zip(tokens, (q_ids, k_ids)))
            self._start(w.shape[1], w)
            if w.dim() == 2:
                self.edges(w, q_tok, k_tok)
            else:
                self._top_rows(w, q_tok, k_tok)

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


def _best(key: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest of every row (float32), best first, ties to the lower column (columns
    in index order); a row's entries <= 0 rank below every weight. One ``topk`` of int64
    keys that hold the weight's bits (a nonnegative float32's bits keep its order) above
    the reversed column, so no two keys tie."""
    last = key.shape[-1] - 1
    bits = key.float().clamp(min=0).view(torch.int32).long()
    top = ((bits << 32) | (last - torch.arange(last + 1, device=key.device))).topk(k).values
    return (top >> 32).int().view(torch.float32), last - (top & 0xFFFFFFFF)


def _ascending(k_tok: Tensor) -> bool:
    """Whether the real key columns of every slot come in increasing token order."""
    ids = torch.where(k_tok >= 0, k_tok, -1)
    return bool(((ids >= ids.cummax(dim=-1).values) | (ids < 0)).all())
