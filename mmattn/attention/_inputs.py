"""Input checks of :class:`~mmattn.MultiHeadAttention` (and every variant's ``forward``).

Axis key: ``b`` batch, ``i``/``j`` query/key length, ``d`` model width.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from mmattn import _checks as checks


def check_inputs(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool = False,
) -> bool:
    """Validate shapes, dtypes and devices against ``module``; return whether batched.

    Raises:
        TypeError / ValueError: naming the argument, with the expected and actual values.
    """
    # self-attention (key and value are the query): their own checks would repeat query's
    others = () if key is query and value is query else (("key", key), ("value", value))
    for name, t in (("query", query), *others):
        checks.check_tensor(name, t)
        checks.check_floating(name, t)
    layout = "(batch, length, embed_dim)" if module.batch_first else "(length, batch, embed_dim)"
    checks.check_rank("query", query, (2, 3), f"{layout} or unbatched (length, embed_dim)")
    batched = query.dim() == 3
    for name, t in others:
        if t.dim() != query.dim():
            raise ValueError(
                f"{name} must have the same rank as query ({query.dim()}-D), got "
                f"{t.dim()}-D with shape {tuple(t.shape)}"
            )
    checks.check_last_dim("query", query, module.embed_dim, "embed_dim")
    checks.check_last_dim("key", key, module.kdim, "kdim")
    checks.check_last_dim("value", value, module.vdim, "vdim")
    # Under autocast (CPU or CUDA) the projections cast every input, as in torch.
    autocast = query.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(
        query.device.type
    )
    for name, t in others:
        if not autocast:
            checks.check_same_dtype(name, t, "query", query)
        checks.check_same_device(name, t, "query", query)
    weight = module.q_proj.weight
    checks.check_same_device("query", query, "the module's parameters", weight)
    if query.dtype != weight.dtype and not autocast:
        raise TypeError(
            f"query has dtype {query.dtype} but the module's parameters have dtype "
            f"{weight.dtype}; convert one of them (e.g. module.to({query.dtype}))"
        )
    seq_dim = 1 if batched and module.batch_first else 0
    batch_dim = 1 - seq_dim
    if key.shape[seq_dim] != value.shape[seq_dim]:
        raise ValueError(
            f"key and value must have the same length, got key {tuple(key.shape)} and "
            f"value {tuple(value.shape)}"
        )
    if batched and not (query.shape[batch_dim] == key.shape[batch_dim]
                        == value.shape[batch_dim]):
        raise ValueError(
            f"query, key and value must have the same batch size, got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    batch = query.shape[batch_dim] if batched else None
    q_len, k_len = query.shape[seq_dim], key.shape[seq_dim]
    if key_padding_mask is not None:
        checks.check_tensor("key_padding_mask", key_padding_mask)
        checks.check_mask_dtype("key_padding_mask", key_padding_mask)
        checks.check_same_device("key_padding_mask", key_padding_mask, "query", query)
        expected = (batch, k_len) if batched else (k_len,)
        checks.check_shape(
            "key_padding_mask", key_padding_mask, expected,
            "(batch, key_length)" if batched else "(key_length,)",
        )
    if attn_mask is not None:
        checks.check_tensor("attn_mask", attn_mask)
        checks.check_mask_dtype("attn_mask", attn_mask)
        checks.check_same_device("attn_mask", attn_mask, "query", query)
        stacked = (batch if batched else 1) * module.num_heads
        if attn_mask.shape not in ((q_len, k_len), (stacked, q_len, k_len)):
            raise ValueError(
                f"attn_mask must have shape {(q_len, k_len)} or "
                f"{(stacked, q_len, k_len)} (batch * num_heads, query_length, key_length), "
                f"got {tuple(attn_mask.shape)}"
            )
    module._check_lengths([q_len], [k_len], is_causal=is_causal, attn_mask=attn_mask)
    return batched


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``rearrange(x, "b l (h e) -> b h l e", h=heads)`` without einops' per-call parsing
    (the same view: a reshape and a transpose; the hot path of every forward)."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """``rearrange(x, "b h l e -> b l (h e)")`` (the same reshape, see :func:`split_heads`)."""
    return x.transpose(1, 2).flatten(2)


def to_batch_first(
    module: nn.Module, batched: bool, query: Tensor, key: Tensor, value: Tensor,
    key_padding_mask: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Checked inputs as (b, l, d) batches: unbatched ones gain b = 1, ``batch_first=False``
    ones are transposed (undone by :func:`from_batch_first`)."""
    if not batched:
        query, key, value = query[None], key[None], value[None]
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask[None]
    elif not module.batch_first:
        query, key, value = (rearrange(t, "l b d -> b l d") for t in (query, key, value))
    return query, key, value, key_padding_mask


def from_batch_first(
    module: nn.Module, batched: bool, out: Tensor, weights: Tensor | None, average: bool
) -> tuple[Tensor, Tensor | None]:
    """The output in the caller's layout, and the weights averaged over heads if asked."""
    if not batched:
        out = out[0]
    elif not module.batch_first:
        out = rearrange(out, "b l d -> l b d")
    if weights is not None:
        if average:
            weights = weights.mean(dim=1)
        if not batched:
            weights = weights[0]
    return out, weights
