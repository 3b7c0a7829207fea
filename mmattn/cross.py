"""``CrossAttention``: a query sequence attends a required context sequence.

Axis key: ``b`` batch, ``i`` query length, ``j`` context length, ``d`` model width.

The same module as :class:`mmattn.MultiHeadAttention` — arguments, masks (module direction,
True = NOT allowed), outputs — with the context (``key``) required and ``vdim`` defaulting to
``kdim``, so that a context of another width serves as both key and value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmattn._helpers import default
from mmattn.attention import MultiHeadAttention

__all__ = ["CrossAttention"]


class CrossAttention(MultiHeadAttention):
    """Multi-head attention of a query sequence over a required context sequence.

    The same module as :class:`MultiHeadAttention` (same arguments, masks and outputs), but
    ``key`` (the context) must be given, and ``vdim`` defaults to ``kdim`` so that a context
    of width ``kdim`` serves as both key and value.

    Shape:
        - query: (B, L, embed_dim); key (context): (B, S, kdim); value: (B, S, vdim)
        - returns: (B, L, embed_dim), weights (B, L, S) when ``need_weights``

    Examples:
        >>> xattn = CrossAttention(embed_dim=32, num_heads=4, kdim=12)
        >>> text, image = torch.randn(2, 7, 32), torch.randn(2, 49, 12)
        >>> xattn(text, image)[0].shape
        torch.Size([2, 7, 32])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            embed_dim,
            num_heads,
            dropout=dropout,
            bias=bias,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            kdim=kdim,
            vdim=default(vdim, kdim),
            batch_first=batch_first,
            device=device,
            dtype=dtype,
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend ``query`` over the context ``key`` (required) and ``value``."""
        if key is None:
            raise TypeError("CrossAttention.forward requires key (the context sequence), got None")
        return super().forward(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
            is_causal,
        )
