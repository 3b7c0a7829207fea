"""Jagged (``torch.nested``, layout ``torch.jagged``) tensors: wrap, unwrap, pad, concatenate.

Axis key: ``b`` items, ``t`` tokens of the whole batch (``t = Σ lᵢ``), ``d`` feature width.

A packed batch is one (t, d) ``values()`` buffer and ``offsets()`` (b + 1,) where item ``m``
owns rows ``[offsets[m], offsets[m + 1])``. These helpers sit below both the data type
(:class:`mmattn.Tokens`) and the kernels (:mod:`mmattn.kernels.packed`), which import them
from here; they import nothing of mmattn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# torch.compile: the jagged boundary (wrapping, unwrapping) runs eagerly (graph breaks; the
# packed kernel's bucket planning too); the dense work between them (projections, norms,
# MLPs, each bucket's attention) is compiled. Tracing through NJT subclass outputs fails
# in torch 2.14 ("outputs that alias one another ... with tensor subclass outputs").
_boundary = torch.compiler.disable

try:  # the jagged layout's tensor subclass (private module; fall back to the layout check)
    from torch.nested._internal.nested_tensor import NestedTensor as _NJT
except ImportError:  # pragma: no cover
    _NJT = None


def is_jagged(value: object) -> bool:
    """True for a jagged-layout ``torch.nested`` tensor (a class check: attribute reads on a
    nested tensor go through ``__torch_function__`` and cost microseconds each)."""
    if _NJT is not None:
        return isinstance(value, _NJT)
    return isinstance(value, Tensor) and value.is_nested and value.layout == torch.jagged


@_boundary
def jagged(values: Tensor, offsets: Tensor) -> Tensor:
    """A jagged nested tensor (b, j*, ...) viewing ``values`` (zero-copy)."""
    return torch.nested.nested_tensor_from_jagged(values, offsets)


@_boundary
def contiguous_parts(nt: Tensor) -> tuple[Tensor, Tensor]:
    """``(values, offsets)`` of a jagged tensor, made contiguous if it has holes."""
    if nt._lengths is not None:  # a narrowed NJT: its rows are not back to back
        nt = nt.contiguous()
    values, offsets = nt.values(), nt.offsets()
    first = int(offsets[0]) if offsets.numel() else 0
    if first:  # a view starting inside its buffer: re-base to 0
        values, offsets = values[first : int(offsets[-1])], offsets - first
    return values, offsets


def runs_of(ids: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """(counts, starts), each (size,): how many of the sorted ``ids`` (values in 0 .. size-1)
    equal each value, and where that run starts (a fixed-size index_add, no host read).

    Examples:
        >>> [t.tolist() for t in runs_of(torch.tensor([0, 0, 2]), 4)]
        [[2, 0, 1, 0], [0, 2, 2, 3]]
    """
    counts = torch.zeros(size, dtype=torch.long, device=ids.device)
    counts.index_add_(0, ids, torch.ones_like(ids))
    return counts, torch.cumsum(counts, 0) - counts


def owners(offsets: Tensor, total: int) -> Tensor:
    """(t,) long: the item each packed row belongs to."""
    batch = offsets.shape[0] - 1
    return torch.repeat_interleave(
        torch.arange(batch, device=offsets.device), offsets.diff(), output_size=total
    )


def pad_values(values: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    """Packed rows to a left-aligned padded batch (zeros at padding) and its real-token mask.

    Shape:
        - values: (t, d); offsets: (b + 1,)
        - returns: (b, l_max, d) and (b, l_max) bool
    """
    lens = offsets.diff()
    batch = lens.shape[0]
    longest = int(lens.max()) if batch else 0
    mask = torch.arange(longest, device=values.device) < lens[:, None]
    total = values.shape[0]
    rows = owners(offsets, total) * longest
    rows = rows + torch.arange(total, device=values.device) - offsets[:-1].repeat_interleave(
        lens, output_size=total
    )
    flat = values.new_zeros(batch * longest, *values.shape[1:]).index_copy(0, rows, values)
    return flat.view(batch, longest, *values.shape[1:]), mask


def cat_values(
    parts: list[tuple[Tensor, Tensor]],
) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
    """Concatenate packed batches per item: item m of the result is item m of every part.

    Returns:
        ``values`` (t, d), ``offsets`` (b + 1,), and per part the (b,) start and stop of its
        tokens inside each item.
    """
    lens = torch.stack([offsets.diff() for _, offsets in parts])  # (parts, b)
    total_lens = lens.sum(dim=0)
    offsets = F.pad(total_lens.cumsum(0), (1, 0))
    before = lens.cumsum(dim=0) - lens  # tokens of earlier parts inside each item
    dest, spans = [], []
    for index, (values, part_offsets) in enumerate(parts):
        total = values.shape[0]
        owner = owners(part_offsets, total)
        local = torch.arange(total, device=values.device) - part_offsets[:-1][owner]
        dest.append(offsets[:-1][owner] + before[index][owner] + local)
        spans.append((before[index], before[index] + lens[index]))
    dest_all = torch.cat(dest)
    order = torch.empty_like(dest_all).scatter_(
        0, dest_all, torch.arange(dest_all.shape[0], device=dest_all.device)
    )
    values = torch.cat([v for v, _ in parts]).index_select(0, order)
    return values, offsets, spans
