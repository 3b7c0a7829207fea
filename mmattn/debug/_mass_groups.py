"""Which token is which: the token layout of an attention call and its modality groups.

Axis key: ``b`` items, ``l`` positions of an item, ``t`` flat tokens (``b·L + l`` padded,
the rows of ``values()`` packed).

Groups come from ``Tokens.meta`` (DESIGN, "Token attributes"): ``meta["modality_ids"]``
(B, L) indexing ``meta["modalities"]`` with ``meta["segments"]`` for interleaved sequences,
else ``meta["spans"]`` (``{name: (start, stop)}``, ints or per-item (B,) tensors). With
``by="modality"`` a group is a modality; with ``by="segment"`` it is one segment, named by
its modality and its rank among that modality's segments in the item: ``"image[0]"``,
``"image[1]"``, so the second image of every item is one group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmattn._checks import check_names
from mmattn._jagged import contiguous_parts, owners
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
    """

    batch: int
    length: int
    offsets: Tensor
    real: Tensor
    item: Tensor
    pos: Tensor

    @property
    def lengths(self) -> Tensor:
        return self.offsets.diff()

    @staticmethod
    def padded(batch: int, length: int, real: Tensor | None, device) -> Layout:
        offsets = torch.arange(batch + 1, device=device) * length
        ids = torch.arange(batch * length, device=device)
        if real is None:
            real = torch.ones(batch * length, dtype=torch.bool, device=device)
        return Layout(batch, length, offsets, real.reshape(-1).to(device), ids // max(length, 1),
                      ids % max(length, 1))

    @staticmethod
    def packed(offsets: Tensor) -> Layout:
        offsets = offsets.long()
        total = int(offsets[-1])
        item = owners(offsets, total)
        pos = torch.arange(total, device=offsets.device) - offsets[:-1][item]
        lengths = offsets.diff()
        longest = int(lengths.max()) if lengths.numel() else 0
        real = torch.ones(total, dtype=torch.bool, device=offsets.device)
        return Layout(len(offsets) - 1, longest, offsets, real, item, pos)

    @staticmethod
    def of(tokens: Tokens) -> Layout:
        if tokens.is_packed:
            return Layout.packed(contiguous_parts(tokens.x)[1])
        mask = None if tokens.mask is None else tokens.mask.reshape(-1)
        return Layout.padded(tokens.batch_size, tokens.length, mask, tokens.x.device)

    def matches(self, other: Layout) -> bool:
        return (self.batch, self.length) == (other.batch, other.length) and bool(
            torch.equal(self.offsets.cpu(), other.offsets.cpu())
        )


def _flat(value: Tensor, layout: Layout, name: str) -> Tensor:
    """A per-token attribute as (t,): from (B, L), (t,) or a jagged (B, j*) tensor."""
    if not isinstance(value, Tensor):
        raise TypeError(f"meta[{name!r}] must be a tensor, got {type(value).__name__}")
    if value.is_nested:
        value = value.values()
    total = int(layout.offsets[-1])
    if value.dim() == 2 and tuple(value.shape) == (layout.batch, layout.length):
        if value.shape[0] * value.shape[1] == total:
            return value.reshape(-1).long()
        return value[layout.item, layout.pos].long()
    if value.dim() == 1 and value.shape[0] == total:
        return value.long()
    raise ValueError(
        f"meta[{name!r}] must be (B, L) = {(layout.batch, layout.length)} or one id per token "
        f"({total},), got {tuple(value.shape)}"
    )


def _span_ids(spans: dict, layout: Layout) -> Tensor:
    """(t,) the index of the span each token lies in (-1: none)."""
    group = torch.full_like(layout.pos, -1)
    for index, (start, stop) in enumerate(spans.values()):
        start = torch.as_tensor(start, device=layout.pos.device)
        stop = torch.as_tensor(stop, device=layout.pos.device)
        if start.dim():
            start, stop = start[layout.item], stop[layout.item]
        group = torch.where((layout.pos >= start) & (layout.pos < stop), index, group)
    return group


def _runs(ids: Tensor, layout: Layout) -> Tensor:
    """Segment ids: one per contiguous run of equal ``ids`` inside an item (-1 stays -1)."""
    same = torch.zeros_like(ids, dtype=torch.bool)
    same[1:] = (ids[1:] == ids[:-1]) & (layout.item[1:] == layout.item[:-1])
    return torch.where(ids < 0, -1, torch.cumsum(~same, 0) - 1)


def token_groups(tokens: Tokens, layout: Layout, by: str) -> tuple[list[str], Tensor] | None:
    """The group names and the (t,) group of every token, or None without modality facts.

    Raises:
        ValueError: ``meta["modality_ids"]`` without ``meta["modalities"]``, ids out of
            range, or attributes of the wrong shape.
    """
    meta = tokens.meta
    if "modality_ids" in meta:
        if "modalities" not in meta:
            raise ValueError(
                "meta['modality_ids'] indexes meta['modalities'] (the names), which is missing"
            )
        names = list(check_names("meta['modalities']", meta["modalities"]))
        modality = _flat(meta["modality_ids"], layout, "modality_ids")
        if modality.numel() and int(modality.max()) >= len(names):
            raise ValueError(
                f"meta['modality_ids'] holds id {int(modality.max())} but meta['modalities'] "
                f"names only {len(names)}: {names}"
            )
        segments = None
        if "segments" in meta:
            segments = _flat(meta["segments"], layout, "segments")
    elif isinstance(meta.get("spans"), dict) and meta["spans"]:
        names = [str(name) for name in meta["spans"]]
        modality = segments = _span_ids(meta["spans"], layout)
    else:
        return None
    modality = torch.where(layout.real, modality, -1)
    if by == "modality":
        return names, modality
    if segments is None:
        segments = _runs(modality, layout)
    return _segment_groups(names, modality, torch.where(modality < 0, -1, segments), layout)


def _segment_groups(
    names: list[str], modality: Tensor, segments: Tensor, layout: Layout
) -> tuple[list[str], Tensor]:
    """Group = (modality, rank of the segment among the item's segments of that modality)."""
    labels: list[str] = []
    group = torch.full_like(segments, -1)
    item, seg, mod = (t.tolist() for t in (layout.item, segments, modality))
    seen: dict[tuple[int, int], int] = {}  # (item, segment) -> label index
    ranks: dict[tuple[int, int], int] = {}  # (item, modality) -> segments so far
    out = []
    for b, s, m in zip(item, seg, mod):
        if s < 0 or m < 0:
            out.append(-1)
            continue
        if (b, s) not in seen:
            rank = ranks.get((b, m), 0)
            ranks[(b, m)] = rank + 1
            label = f"{names[m]}[{rank}]"
            if label not in labels:
                labels.append(label)
            seen[(b, s)] = labels.index(label)
        out.append(seen[(b, s)])
    if out:
        group = torch.tensor(out, dtype=torch.long, device=segments.device)
    return labels, group
