"""Geometry through fusion: the parts' ``meta["edge_index"]`` in the fused token order.

Axis key: ``b`` items, ``l`` fused length, ``E`` edges.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mmattn.kernels.packed import contiguous_parts
from mmattn.tokens import Tokens


def fused_edges(parts: Mapping[str, Tokens], fused: Tokens) -> Tensor | None:
    """Every part's ``meta["edge_index"]``, re-indexed into ``fused`` (``Tokens.cat(parts)``).

    A part's token at flat row ``b·L_p + i`` (padded) or at position ``i`` of item ``b``
    (packed) sits at position ``start_b + i`` of item ``b`` of the fused sequence, so its
    edges move there; tokens of parts without edges get none. None when no part has edges.

    Shape:
        - returns: (2, E_total) int64, the parts' edges one after another
    """
    spans = fused.meta["spans"]
    pieces = []
    for name, part in parts.items():
        edges = part.meta.get("edge_index")
        if edges is None:
            continue
        edges = edges.long()
        start = spans[name][0]
        if fused.is_packed:
            _, part_off = contiguous_parts(part.x)
            _, off = contiguous_parts(fused.x)
            item = torch.searchsorted(part_off[1:], edges.reshape(-1), right=True)
            item = item.view_as(edges)
            pieces.append(off[item] + start[item] + edges - part_off[item])
        else:
            length = max(part.length, 1)
            pieces.append((edges // length) * fused.length + start + edges % length)
    return torch.cat(pieces, dim=1) if pieces else None
