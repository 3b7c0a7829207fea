"""Checked public attention functions on head-split (..., i, e) tensors.

Axis key: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``e`` head width.

The mask convention mirrors ``torch.nn.functional.scaled_dot_product_attention``: a boolean
``attn_mask`` is **True where query i may attend key j**; a float mask is added to the scores.
Unlike plain SDPA math, a query row with no allowed key returns zeros (and zero weights), and
its gradients stay finite.

These functions validate their arguments and call the unchecked kernel in
:mod:`mmattn.kernels.dense` (dense) or :mod:`mmattn.kernels.blocked` (sliding window). The
fused / explicit switch lives there and is re-exported here: :func:`use_fused_attn`,
:func:`set_fused_attn`, :func:`fused_attn` (``MMATTN_FUSED_ATTN=0`` in the environment forces
the explicit path).
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from mmattn._checks import (
    check_bool,
    check_floating,
    check_mask_dtype,
    check_number,
    check_positive_int,
    check_probability,
    check_rank,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from mmattn.kernels.blocked import local_attend
from mmattn.kernels.dense import attend, fused_attn, set_fused_attn, use_fused_attn

__all__ = [
    "local_attention",
    "scaled_dot_product_attention",
    "use_fused_attn",
    "set_fused_attn",
    "fused_attn",
]

def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        check_tensor(name, t)
        check_floating(name, t)
    check_rank("query", q, range(2, 8), "(..., L, E)")
    if k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            f"query, key and value must have the same rank, got query {tuple(q.shape)}, "
            f"key {tuple(k.shape)}, value {tuple(v.shape)}"
        )
    check_same_dtype("key", k, "query", q)
    check_same_dtype("value", v, "query", q)
    check_same_device("key", k, "query", q)
    check_same_device("value", v, "query", q)
    if q.shape[:-2] != k.shape[:-2] or q.shape[:-2] != v.shape[:-2]:
        raise ValueError(
            "query, key and value must share leading (batch, head) dimensions, got query "
            f"{tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}"
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"key must have the same last dimension as query ({q.shape[-1]}), got key "
            f"{tuple(k.shape)}"
        )
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"value must have the same length as key ({k.shape[-2]}), got value {tuple(v.shape)}"
        )


def _check_attn_mask(mask: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """Validate ``attn_mask``; return it with at least 2 dims (a (S,) mask is (1, S))."""
    check_tensor("attn_mask", mask)
    check_mask_dtype("attn_mask", mask)
    # torch's SDPA rule: a float mask is float32 (e.g. a bias kept in full precision under
    # bf16 / fp16 queries, added to the float32 scores) or query's own dtype
    if mask.is_floating_point() and mask.dtype not in (q.dtype, torch.float32):
        raise TypeError(
            f"attn_mask must be bool or have dtype float32 or the dtype of query ({q.dtype}), "
            f"got {mask.dtype}"
        )
    check_same_device("attn_mask", mask, "query", q)
    target = (*q.shape[:-1], k.shape[-2])
    ok = mask.dim() <= len(target) and all(
        m in (1, t) for m, t in zip(mask.shape[::-1], target[::-1])
    )
    if not ok:
        raise ValueError(
            f"attn_mask must broadcast to (..., L, S) = {target}, got {tuple(mask.shape)}"
        )
    return mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 2 else mask


def _check_options(dropout_p: object, is_causal: object, scale: object) -> None:
    check_probability("dropout_p", dropout_p)
    check_bool("is_causal", is_causal)
    if scale is not None:
        check_number("scale", scale)


@overload
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    *,
    need_weights: Literal[False] = ...,
) -> Tensor: ...


@overload
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = ...,
    dropout_p: float = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    *,
    need_weights: Literal[True],
) -> tuple[Tensor, Tensor]: ...


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    need_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Scaled dot-product attention, ``F.scaled_dot_product_attention`` with safe masks.

    .. math::
        \mathrm{out} = \mathrm{softmax}\!\left(\frac{q k^\top}{\sqrt{e}} + M\right) v

    A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (same argument order,
    same mask direction, dropout applied whenever ``dropout_p > 0``), with two additions: a
    query row whose keys are all masked returns zeros (never NaN, also in the gradient), and
    ``need_weights=True`` also returns the attention weights.

    Args:
        query, key, value: projected, head-split tensors.
        attn_mask: bool (True = may attend) or float (added to scores) in query's dtype or
            float32 (as torch's SDPA: a float32 bias with bf16 / fp16 queries is added to
            the float32 scores), broadcastable to (..., L, S), any rank up to query's (a
            (S,) mask applies to every query). A float mask holding ``+inf`` or NaN behaves
            as in torch: the rows it touches come out NaN, on both paths, and nothing else.
        dropout_p: dropout probability on the attention weights.
        is_causal: apply a causal mask (query i sees keys j <= i), combined with
            ``attn_mask`` when both are given.
        scale: score scale, a finite number; default ``1 / sqrt(E)``.
        need_weights: also return the (post-dropout) attention weights.

    Shape:
        - query: (..., L, E); key: (..., S, E); value: (..., S, Ev); ``...`` may be empty
          ((L, E) inputs, as torch's SDPA takes them)
        - returns: (..., L, Ev), and weights (..., L, S) when ``need_weights``.

    Raises:
        TypeError: non-tensor or non-floating inputs, mismatched dtypes, a mask that is
            neither bool nor float32 nor of query's floating dtype; ``dropout_p`` or ``scale`` not a
            number, ``is_causal`` not a bool.
        ValueError: mismatched ranks, leading dims, widths or lengths; a mask that does not
            broadcast to (..., L, S); inputs on different devices; ``dropout_p`` outside
            [0, 1); a NaN or infinite ``scale``.

    Examples:
        >>> q = k = v = torch.randn(2, 4, 5, 8)
        >>> scaled_dot_product_attention(q, k, v).shape
        torch.Size([2, 4, 5, 8])
        >>> out, w = scaled_dot_product_attention(q, k, v, need_weights=True)
        >>> w.shape
        torch.Size([2, 4, 5, 5])
    """
    _check_qkv(query, key, value)
    if attn_mask is not None:
        attn_mask = _check_attn_mask(attn_mask, query, key)
    _check_options(dropout_p, is_causal, scale)
    single = query.dim() == 2  # (L, E), as torch's SDPA takes: one head of one sequence
    if single:
        query, key, value = query[None], key[None], value[None]
    out, weights = attend(
        query,
        key,
        value,
        attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        need_weights=need_weights,
    )
    if single:
        out, weights = out[0], None if weights is None else weights[0]
    return (out, weights) if need_weights else out


def local_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    window_size: int,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
) -> Tensor:
    r"""Sliding-window attention in O(L·window) time and memory.

    .. math::
        \mathrm{out}_i = \mathrm{softmax}_{j:\,|i-j| \le w}\!\left(
            \frac{q_i k_j^\top}{\sqrt{e}}\right) v

    Equal to :func:`scaled_dot_product_attention` with
    ``attn_mask=masks.band_mask(L, window_size, causal=causal) & key_mask`` but computed
    blockwise (:mod:`mmattn.kernels.blocked`), so no (L, L) tensor is built. A query whose window
    holds no real key returns zeros. ``MMATTN_FUSED_ATTN=0`` selects the explicit path.

    Args:
        query, key, value: projected tensors of one sequence length L.
        window_size: w >= 0; query i sees keys j with ``|i - j| <= w``.
        causal: additionally require ``j <= i``.
        key_mask: (B, L) bool, **True = real key** (the SDPA / ``Tokens.mask`` direction).

    Shape:
        - query, key: (B, H, L, E) or (B, L, E); value: (B, H, L, Ev) or (B, L, Ev)
        - key_mask: (B, L)
        - returns: (B, H, L, Ev) or (B, L, Ev), like the input.

    Raises:
        TypeError: ``window_size`` is not an int, ``causal`` not a bool; non-floating inputs
            or mismatched dtypes; ``key_mask`` is not bool.
        ValueError: ``window_size`` < 0; inputs not 3-D or 4-D, of different lengths or
            leading dims; ``key_mask`` of the wrong shape or device.

    Examples:
        >>> q = k = v = torch.randn(2, 4, 100, 8)
        >>> local_attention(q, k, v, window_size=3).shape
        torch.Size([2, 4, 100, 8])
    """
    _check_qkv(query, key, value)
    check_rank("query", query, (3, 4), "(batch, heads, length, E) or (batch, length, E)")
    check_positive_int("window_size", window_size, minimum=0)
    check_bool("causal", causal)
    if key.shape[-2] != query.shape[-2]:
        raise ValueError(
            f"key must have the same length as query ({query.shape[-2]}) for local attention, "
            f"got key {tuple(key.shape)}"
        )
    if key_mask is not None:
        check_tensor("key_mask", key_mask)
        check_mask_dtype("key_mask", key_mask, allow_float=False)
        check_same_device("key_mask", key_mask, "query", query)
        expected = (query.shape[0], key.shape[-2])
        if tuple(key_mask.shape) != expected:
            raise ValueError(
                f"key_mask must have shape {expected} (batch, key_length), "
                f"got {tuple(key_mask.shape)}"
            )
    unbatched_heads = query.dim() == 3
    if unbatched_heads:
        query, key, value = query[:, None], key[:, None], value[:, None]
    out, _ = local_attend(query, key, value, window_size, causal=causal, key_mask=key_mask)
    return out[:, 0] if unbatched_heads else out
