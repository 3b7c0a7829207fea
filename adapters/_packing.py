"""Helpers for adapters that emit packed Tokens (``packed=True``).

Axis key: ``t`` packed tokens of the whole batch, ``b`` sequences, ``l`` the longest one,
``d`` model width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def local_positions(offsets: Tensor, total: int) -> Tensor:
    """(t,) long: each packed token's position inside its own sequence (0, 1, ...)."""
    lengths = offsets.diff()
    starts = offsets[:-1].repeat_interleave(lengths, output_size=total)
    return torch.arange(total, device=offsets.device) - starts


def add_positions(position: nn.Module, values: Tensor, offsets: Tensor) -> Tensor:
    """``values`` plus a 1-D position module's encoding, each sequence from position 0.

    ``position(x)`` adds (1, l, d) positions to x (sinusoidal, learned or identity); its table
    is read once for the longest sequence and indexed per token, so no padded batch is built.

    Shape:
        - values: (t, d); offsets: (b + 1,); returns (t, d)
    """
    lengths = offsets.diff()
    longest = int(lengths.max()) if lengths.numel() else 0
    table = position(values.new_zeros(1, longest, values.shape[-1]))[0]  # (l, d)
    return values + table[local_positions(offsets, values.shape[0])]


def packed_from_mask(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The real rows of a (b, l, ...) tensor under a (b, l) mask, and their offsets."""
    offsets = torch.nn.functional.pad(mask.sum(dim=1).cumsum(0), (1, 0))
    return values[mask], offsets

