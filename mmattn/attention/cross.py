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
from mmattn.attention.mha import MultiHeadAttention
from mmattn.cache import ContextCache

__all__ = ["CrossAttention"]


class CrossAttention(MultiHeadAttention):
    """Multi-head attention of a query sequence over a required context sequence.

    The same module as :class:`MultiHeadAttention` (same arguments, masks and outputs), but
    ``key`` (the context) must be given, and ``vdim`` defaults to ``kdim`` so that a context
    of width ``kdim`` serves as both key and value.

    ``num_kv_heads`` works as in :class:`MultiHeadAttention`; ``position=`` and
    ``alibi=True`` raise ValueError (two sequences have no relative position); ``sinks`` and
    ``softcap`` work as there. For decoding, :meth:`make_cache`
    returns a :class:`~mmattn.cache.ContextCache` that projects the context once.

    Shape:
        - query: (B, L, embed_dim); key (context): (B, S, kdim); value: (B, S, vdim)
        - returns: (B, L, embed_dim), weights (B, L, S) when ``need_weights``

    Examples:
        >>> xattn = CrossAttention(embed_dim=32, num_heads=4, kdim=12)
        >>> text, image = torch.randn(2, 7, 32), torch.randn(2, 49, 12)
        >>> xattn(text, image)[0].shape
        torch.Size([2, 7, 32])
    """

    #: Only the projected context: a self-attention cache would take context keys as steps.
    cache_kinds = (ContextCache,)
    #: Why ``alibi=True`` is refused (see :mod:`mmattn.attention._modifiers`).
    alibi_refusal = "query and context are two sequences, so no query is at a distance from a key"
    #: A compiled pattern (SparseMask) is a self-attention mask: refused (attention/_sparse.py).
    takes_sparse_mask = False

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
        *,
        num_kv_heads: int | None = None,
        position: None = None,
        sinks: bool = False,
        softcap: float | None = None,
        alibi: bool = False,
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
            num_kv_heads=num_kv_heads,
            position=position,
            sinks=sinks,
            softcap=softcap,
            alibi=alibi,
        )

    def _check_position_supported(self) -> None:
        if self.position is not None:
            raise ValueError(
                "position= is not supported by CrossAttention: query and context are two "
                "sequences, so their relative position has no meaning; encode positions in "
                "each sequence before attending"
            )

    def make_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> ContextCache:
        """A cache that projects the context once: ``forward(q_step, context, cache=cache)``.

        The first call stores the projected keys and values of ``context`` (and its
        ``key_padding_mask``); every later call reuses them and ignores the context passed.

        Args:
            batch_size: the batch every call has. max_len: the longest context it holds.
            device, dtype: of the buffers (default: those of ``k_proj``'s weight).
        """
        self._check_cacheable()
        weight = self.k_proj.weight
        return ContextCache(
            batch_size, max_len, self.num_kv_heads, self.head_dim,
            device=default(device, weight.device), dtype=default(dtype, weight.dtype),
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
        *,
        cache: ContextCache | None = None,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend ``query`` over the context ``key`` (required) and ``value``; ``positions``
        raises a ValueError naming it (cross-attention has no position module)."""
        if key is None:
            raise TypeError("CrossAttention.forward requires key (the context sequence), got None")
        return super().forward(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
            is_causal, cache=cache, positions=positions,
        )
