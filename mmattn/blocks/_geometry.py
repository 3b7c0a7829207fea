"""Geometry through fusion: the parts' ``meta["edge_index"]`` (and ``meta["edge_bias"]``) in
the fused token order.

Axis key: ``b`` items, ``l`` fused length, ``E`` edges, ``h`` heads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mmattn.kernels.packed import contiguous_parts
from mmattn.tokens import Tokens


def fused_edges(
    parts: Mapping[str, Tokens], fused: Tokens
) -> tuple[Tensor | None, Tensor | None]:
    """Every part's ``meta["edge_index"]``, re-indexed into ``fused`` (``Tokens.cat(parts)``),
    and the ``meta["edge_bias"]`` that follows them.

    A part's token at flat row ``b·L_p + i`` (padded) or at position ``i`` of item ``b``
    (packed) sits at position ``start_b + i`` of item ``b`` of the fused sequence, so its
    edges move there; tokens of parts without edges get none. The biases of the parts'
    edges are concatenated in the same order (a part with edges but no bias adds zeros);
    None when no part has a bias, and both None when no part has edges.

    Shape:
        - returns: (2, E_total) int64, the parts' edges one after another; (E_total, h)

    Raises:
        ValueError: the parts' biases do not fit their edges or disagree on the heads.
    """
    spans = fused.meta["spans"]
    pieces, biases = [], []
    for name, part in parts.items():
        edges = part.meta.get("edge_index")
        if edges is None:
            continue
        edges = edges.long()
        bias = part.meta.get("edge_bias")
        if bias is not None and (bias.dim() != 2 or bias.shape[0] != edges.shape[-1]):
            raise ValueError(
                f"meta['edge_bias'] of {name!r} must have shape (num_edges, num_heads) with "
                f"num_edges={edges.shape[-1]}, got {tuple(bias.shape)}"
            )
        biases.append((name, edges.shape[-1], bias))
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
    if not pieces:
        return None, None
    return torch.cat(pieces, dim=1), _fused_bias(biases)


def _fused_bias(biases: list[tuple[str, int, Tensor | None]]) -> Tensor | None:
    """The parts' (E_p, h) biases one after another, zeros for a part without one."""
    given = [(name, bias) for name, _, bias in biases if bias is not None]
    if not given:
        return None
    heads = {name: bias.shape[1] for name, bias in given}
    if len(set(heads.values())) > 1:
        raise ValueError(
            f"meta['edge_bias'] of the parts must have one number of heads, got {heads}"
        )
    like = given[0][1]
    return torch.cat([
        like.new_zeros(count, like.shape[1]) if bias is None else bias
        for _, count, bias in biases
    ])
