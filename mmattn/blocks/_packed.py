"""Packed Tokens inside blocks: the (t, d) rows of a jagged batch through any attention.

Axis key: ``t`` packed tokens, ``d`` model width, ``b`` items.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from mmattn.attention.mha import MultiHeadAttention
from mmattn.kernels.packed import contiguous_parts, jagged
from mmattn.tokens import Tokens


def check_same_layout(name: str, tokens: Tokens, other_name: str, other: Tokens) -> None:
    """Raise TypeError when one of two Tokens is packed and the other padded."""
    if tokens.is_packed != other.is_packed:
        kinds = {True: "packed", False: "padded"}
        raise TypeError(
            f"{name} is {kinds[tokens.is_packed]} but {other_name} is "
            f"{kinds[other.is_packed]}; pack() or unpack() both"
        )


def map_packed(tokens: Tokens, fn) -> Tokens:
    """Packed Tokens with ``fn`` applied to the (t, d) values (same offsets and meta)."""
    values, offsets = contiguous_parts(tokens.x)
    return tokens.replace(jagged(fn(values), offsets))


def attend_packed(
    attn: nn.Module,
    values: Tensor,
    offsets: Tensor,
    context: tuple[Tensor, Tensor] | None = None,
    **kwargs: Any,
) -> Tensor:
    """Packed attention on the (t, d) rows: self-attention, or over ``context`` rows.

    An mmattn layer runs its own :meth:`~mmattn.MultiHeadAttention.attend_rows` on the rows
    directly (wrapping them in jagged tensors and back costs more than a small attention
    call). Any other module gets jagged tensors.

    Shape:
        - values: (t, d); offsets: (b + 1,); context: (rows (s, d_k), offsets (b + 1,))
        - returns: (t, d)
    """
    if isinstance(attn, MultiHeadAttention):
        kv, k_off = (values, offsets) if context is None else context
        return attn.attend_rows(
            values, offsets, kv, k_off, kv, self_attention=context is None, **kwargs
        )
    query = jagged(values, offsets)
    key = query if context is None else jagged(*context)
    return attn(query, key, key, **kwargs)[0].values()
