"""Additive (Bahdanau) multi-head attention: scores from a small tanh network, not a dot product.

Axis key: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``d`` model width,
``e`` head width (``d = h * e``).

Per head, :math:`s_{ij} = w^\\top \\tanh(W_q q_i + W_k k_j)`. The pairwise sum inside the tanh
makes a (b, h, i, j, e) intermediate inherent: memory grows as B·H·L·S·E, E times the
(b, h, i, j) scores of dot-product attention. The default path computes it in query chunks of
at most :data:`CHUNK_ELEMENTS` elements and, when gradients are needed, recomputes each chunk
in the backward pass (activation checkpointing), so peak memory stays bounded; the explicit
twin (``need_weights=True`` or ``MMATTN_FUSED_ATTN=0``) builds it in one piece.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mmattn._helpers import default
from mmattn.attention._modifiers import score_modifiers
from mmattn.attention.mha import MultiHeadAttention
from mmattn.kernels import dense as _kernel
from mmattn.kernels._scores import additive_scores
from mmattn.kernels.modifiers import Modifiers, with_bias

__all__ = ["AdditiveAttention", "additive_scores"]

#: Largest (b, h, i, j, e) block the chunked path materialises at once (64 MiB in fp32).
CHUNK_ELEMENTS = 1 << 24


def _chunked_scores(q: Tensor, k: Tensor, weight: Tensor) -> Tensor:
    """:func:`additive_scores` in query chunks, recomputed in backward when training."""
    b, h, i, e = q.shape
    per_query = max(1, b * h * k.shape[2] * e)
    chunk = max(1, CHUNK_ELEMENTS // per_query)
    if chunk >= i:
        return additive_scores(q, k, weight)
    track = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, weight))
    parts = []
    for start in range(0, i, chunk):
        qc = q[:, :, start:start + chunk]
        if track:
            parts.append(checkpoint(additive_scores, qc, k, weight, use_reentrant=False))
        else:
            parts.append(additive_scores(qc, k, weight))
    return torch.cat(parts, dim=2)


class AdditiveAttention(MultiHeadAttention):
    r"""Multi-head additive (Bahdanau) attention with the :class:`MultiHeadAttention` contract.

    .. math::
        s^h_{ij} = w_h^\top \tanh\!\left(W^h_q q_i + W^h_k k_j\right), \qquad
        \mathrm{out} = W_o\,\mathrm{concat}_h\!\left(\mathrm{softmax}_j(s^h_{ij} + M)\,
        v W^h_v\right)

    ``W_q``, ``W_k``, ``W_v``, ``W_o`` are the usual ``q_proj``, ``k_proj``, ``v_proj``,
    ``out_proj`` (their biases act as the bias inside the tanh); ``score_weight`` holds the
    vector :math:`w_h` of every head. There is no :math:`1/\sqrt{e}` scale: the tanh already
    bounds each term. Query and key widths may differ (``kdim``, ``vdim``). Masks, layouts,
    ``add_bias_kv``/``add_zero_attn`` and the zero result of fully masked rows are those of
    :class:`MultiHeadAttention`.

    Memory: the tanh argument is a (B, H, L, S, E) tensor. Without weights requested it is
    built in query chunks of at most :data:`CHUNK_ELEMENTS` elements, recomputed in backward;
    ``need_weights=True`` or ``MMATTN_FUSED_ATTN=0`` build it whole. Both give equal results.

    Args:
        embed_dim: model width D. num_heads: heads H (must divide D).
        dropout: attention-weight dropout. bias: biases on the four projections.
        add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype: as in
            :class:`MultiHeadAttention`.
        num_kv_heads, position: as in :class:`MultiHeadAttention` (a key head's tanh
            network is shared by its group of query heads; a rotary ``position`` rotates q
            and k before the tanh, which gives absolute, not relative, positions here).
        sinks, softcap, alibi: score modifiers on the additive scores, as in
            :class:`MultiHeadAttention` (always on the explicit softmax: no fused kernel).

    Shape:
        - query: (B, L, D); key: (B, S, kdim); value: (B, S, vdim) (or unbatched / seq-first)
        - returns: (B, L, D), and weights (B, L, S) or (B, H, L, S) when ``need_weights``

    Raises:
        ValueError / TypeError: as :class:`MultiHeadAttention`, naming the argument.

    Examples:
        >>> attn = AdditiveAttention(embed_dim=16, num_heads=2, kdim=6, vdim=6)
        >>> out, w = attn(torch.randn(2, 5, 16), torch.randn(2, 7, 6), need_weights=True)
        >>> out.shape, w.shape
        (torch.Size([2, 5, 16]), torch.Size([2, 5, 7]))
    """

    no_torch_twin = "nn.MultiheadAttention uses dot-product scores, not additive ones"

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
        position: nn.Module | Callable[..., Tensor] | str | None = None,
        sinks: bool = False,
        softcap: float | None = None,
        alibi: bool = False,
    ) -> None:
        super().__init__(
            embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim,
            batch_first, device, dtype, num_kv_heads=num_kv_heads, position=position,
            sinks=sinks, softcap=softcap, alibi=alibi,
        )
        self.score_weight = nn.Parameter(
            torch.empty(num_heads, self.head_dim, device=device, dtype=dtype)
        )
        self._reset_score()

    def reset_parameters(self) -> None:
        """Projections as :class:`MultiHeadAttention`; ``score_weight`` ~ U(±1/√e)."""
        super().reset_parameters()
        self._reset_score()

    def _reset_score(self) -> None:
        bound = 1.0 / math.sqrt(self.head_dim)
        nn.init.uniform_(self.score_weight, -bound, bound)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", score=additive"

    def _attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        *,
        is_causal: bool,
        dropout_p: float,
        need_weights: bool,
        modifiers: Modifiers | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        modifiers = default(modifiers, score_modifiers(self))
        if is_causal:
            mask = _kernel.with_causal(mask, q.shape[2], k.shape[2], q.device)
        explicit = need_weights or not _kernel.use_fused_attn()
        if _kernel.reporting():
            reasons = [
                "additive scores have no fused kernel", *_kernel.explicit_reasons(need_weights)
            ]
            bias = None if modifiers is None else modifiers.terms(
                q.shape[2], k.shape[2], q.device, q.dtype
            )
            _kernel.report(
                "explicit" if explicit else "chunked", reasons, q=q, k=k, v=v,
                mask=with_bias(mask, bias), dropout_p=dropout_p, is_causal=is_causal, scale=None,
                modifiers=modifiers, score_weight=self.score_weight,
            )
        if mask is not None:
            k, v = _kernel.clear_dead_keys(mask, k, v)
        weight = self.score_weight.to(q.dtype)
        scores = additive_scores(q, k, weight) if explicit else _chunked_scores(q, k, weight)
        out, weights = _kernel.grouped_softmax_attend(scores, v, mask, dropout_p, modifiers)
        return out, (weights if need_weights else None)
