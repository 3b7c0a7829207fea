"""Which token is which: the token layout of an attention call and its modality groups.

Axis key: ``b`` items, ``l`` positions of an item, ``t`` flat tokens (``b·L + l`` padded,
the rows of ``values()`` packed), ``n`` slots of a kernel's batch.

Groups are read from ``Tokens.meta`` by the patterns' own reader
(:class:`~mmattn.patterns._context.TokenContext`: ``meta["spans"]``, else
``meta["modality_ids"]`` with ``meta["modalities"]`` and ``meta["segments"]``). With
``by="modality"`` a group is a modality; with ``by="segment"`` one segment, named by its
modality and its rank among that modality's segments in the item (``"image[0]"``,
``"image[1]"``), so the second image of every item is one group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmattn._jagged import contiguous_parts, owners
from mmattn.kernels._tiles import Unsupported
from mmattn.patterns._attributes import runs
from mmattn.patterns._context import TokenContext
from mmattn.tokens import Tokens

BY = ("modality", "segment")


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
    def padded(batch: int, length: int, real: Tensor | None, device) -> Layout:
        ids = torch.arange(batch * length, device=device)
        if real is None:
            real = torch.ones(batch * length, dtype=torch.bool, device=device)
        return Layout(batch, length, torch.arange(batch + 1, device=device) * length,
                      real.reshape(-1).to(device), ids // max(length, 1), ids % max(length, 1))

    @staticmethod
    def packed(offsets: Tensor) -> Layout:
        offsets = offsets.long()
        total, lengths = int(offsets[-1]), offsets.diff()
        item = owners(offsets, total)
        pos = torch.arange(total, device=offsets.device) - offsets[:-1][item]
        longest = int(lengths.max()) if lengths.numel() else 0
        real = torch.ones(total, dtype=torch.bool, device=offsets.device)
        return Layout(len(offsets) - 1, longest, offsets, real, item, pos, True)

    @staticmethod
    def of(tokens: Tokens) -> Layout:
        if tokens.is_packed:
            return Layout.packed(contiguous_parts(tokens.x)[1])
        mask = None if tokens.mask is None else tokens.mask.reshape(-1)
        return Layout.padded(tokens.batch_size, tokens.length, mask, tokens.x.device)

    def fits(self, tokens: Layout) -> bool:
        """Whether a call of this layout runs on ``tokens`` (a packed call: the same items;
        a padded one: the same (B, L), packed Tokens a block unpacks included)."""
        if (self.batch, self.length) != (tokens.batch, tokens.length):
            return False
        return not self.flat or torch.equal(self.offsets.cpu(), tokens.offsets.cpu())

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


def token_groups(tokens: Tokens, by: str) -> tuple[list[str], Tensor | None, Tensor]:
    """The group names, the (B, L) group of every token (-1: padding or none; None without
    modality facts) and the (B, L) real tokens, in the Tokens' padded layout.

    Raises:
        ValueError: malformed modality facts (the patterns' messages).
    """
    ctx = TokenContext(tokens)
    if ctx.meta.get("spans") is None and "modality_ids" not in ctx.meta:
        return [], None, ctx.real
    ids, names = ctx.modalities()
    ids = torch.where(ctx.real, ids, -1)
    if by == "modality":
        return list(names), ids, ctx.real
    segments = ctx.segments()
    segments = runs(ids) if segments is None else torch.where(ids < 0, -1, segments)
    labels: list[str] = []
    out = []
    for mods, segs in zip(ids.tolist(), segments.tolist()):
        seen: dict[int, int] = {}  # segment -> label index
        ranks: dict[int, int] = {}  # modality -> segments so far
        for m, s in zip(mods, segs):
            if s >= 0 and s not in seen:
                label = f"{names[m]}[{ranks.get(m, 0)}]"
                ranks[m] = ranks.get(m, 0) + 1
                labels += [label] if label not in labels else []
                seen[s] = labels.index(label)
            out.append(seen[s] if s >= 0 else -1)
    group = torch.tensor(out, dtype=torch.long, device=ids.device).view_as(ids)
    return labels, group, ctx.real
