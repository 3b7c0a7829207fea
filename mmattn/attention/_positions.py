"""Per-token positions, ``forward(..., positions=)``: checked at the boundary, handed to the
layer's ``position`` module at its one call point.

Axis key: ``b`` batch, ``l`` length, ``a`` position axes, ``t`` packed rows, ``h`` heads,
``e`` head width.

A layer calls its ``position`` module on the head-split queries and keys as
``position(x, where)``. ``where`` is an offset (0, or the cache length while decoding) or,
when the call has ``positions``, those positions: (b, l) for a 1-D rotary module, (b, l, a)
for a module with ``num_axes`` (:class:`~mmattn.rotary.MultiAxisRotary`). Positions are
batch-first whatever the layer's ``batch_first`` (like ``Tokens.meta``); for packed input
they are (b, max lᵢ[, a]), each item's first lᵢ rows (the layout of ``Tokens.unpack()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from mmattn import _checks as checks


def _layout(module: nn.Module) -> tuple[tuple[int, ...], str, str]:
    """The trailing shape of one token's position, its name, and what reads it."""
    position = module.position
    axes = getattr(position, "num_axes", None)
    owner = f"{type(module).__name__}'s {type(position).__name__}"
    if axes is None:
        return (), "", f"{owner} (one axis)"
    return (axes,), ", axes", f"{owner} with num_axes={axes}"


def check_positions(
    module: nn.Module, positions: object, batch: int | None, length: int, like: Tensor,
    *, key_length: int | None = None,
) -> Tensor | None:
    """``positions`` checked for a call of ``batch`` items (None: unbatched) of ``length``
    tokens on ``like``'s device; returned batch-first (an unbatched call gains b = 1).

    Raises:
        ValueError: the layer has no position module; a shape other than (B, L) / (B, L, A)
            (the message gives both); another device; keys of another length than the
            queries (positions are the tokens', so query and key must be the same tokens).
        TypeError: not a tensor; a bool or complex dtype.
    """
    if positions is None:
        return None
    refuse_positions(module, positions)
    checks.check_tensor("positions", positions)
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must hold integers or floats, got {positions.dtype}")
    checks.check_same_device("positions", positions, "query", like)
    tail, axes, owner = _layout(module)
    want = (length, *tail) if batch is None else (batch, length, *tail)
    words = f"({'' if batch is None else 'batch, '}length{axes})"
    if tuple(positions.shape) != want:
        raise ValueError(
            f"positions must have shape {words}={want} for {owner}, got "
            f"{tuple(positions.shape)}"
        )
    if key_length is not None and key_length != length:
        raise ValueError(
            f"positions are the tokens' own, so key must have the query's length {length} "
            f"with positions=, got key length {key_length}"
        )
    return positions if batch is not None else positions[None]


def refuse_positions(module: nn.Module, positions: object) -> None:
    """Raise a ValueError naming ``positions`` when given to a layer without a position
    module (nothing would read them)."""
    if positions is not None and getattr(module, "position", None) is None:
        raise ValueError(
            f"positions= needs a position module, but this {type(module).__name__} has none; "
            "a layer built with position=MultiAxisRotary(head_dim, sections) takes (B, L, A) "
            "positions, one with position='rotary' (B, L)"
        )


def check_packed_positions(
    module: nn.Module, positions: object, lengths: list[int], like: Tensor,
    key_lengths: list[int] | None = None,
) -> Tensor | None:
    """Packed ``positions`` (b, max lᵢ[, a]) checked and gathered to rows (t[, a]).

    Raises:
        ValueError / TypeError: as :func:`check_positions`; keys of other lengths.
    """
    if positions is None:
        return None
    longest = max(lengths, default=0)
    if key_lengths is not None and list(key_lengths) != list(lengths):
        raise ValueError(
            f"positions are the tokens' own, so key must have the query's lengths {lengths} "
            f"with positions=, got key lengths {list(key_lengths)}"
        )
    positions = check_positions(module, positions, len(lengths), longest, like)
    real = torch.arange(longest, device=like.device) < torch.tensor(lengths, device=like.device)[
        :, None
    ]
    return positions[real]


def rotate(module: nn.Module, q: Tensor, k: Tensor, where: int | Tensor) -> tuple[Tensor, Tensor]:
    """``module.position`` on queries and keys (b, h, l, e) at ``where``: an offset or the
    checked (b, l[, a]) positions; unchanged without a position module."""
    position = module.position
    if position is None:
        return q, k
    return position(q, where), position(k, where)


def rotate_rows(module: nn.Module, x: Tensor, rows: Tensor) -> Tensor:
    """``module.position`` on packed rows (t, h, e) at their positions (t[, a])."""
    moved = module.position(rearrange(x, "t h e -> 1 h t e"), rows[None])
    return rearrange(moved, "1 h t e -> t h e")


def positions_from_meta(module: nn.Module, meta: Mapping[str, Any]) -> dict[str, Any]:
    """``{"positions": meta["positions"]}`` for a layer with a position module (what blocks
    pass, see :meth:`~mmattn.MultiHeadAttention.geometry`); else nothing."""
    if getattr(module, "position", None) is None or meta.get("positions") is None:
        return {}
    return {"positions": meta["positions"]}
