"""Nested (B, j*, D) input, as ``nn.TransformerEncoder``'s inference fast path hands it.

Axis key: ``b`` batch, ``i`` query length, ``j`` key length, ``d`` model width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn._helpers import default


def nested_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    key_padding_mask: Tensor | None,
    need_weights: bool,
    attn_mask: Tensor | None,
    average_attn_weights: bool,
    is_causal: bool,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``module.forward`` on nested (B, j*, D) tensors: pad, attend with a key padding mask,
    and return a nested output of the query's layout and lengths.

    This is what ``nn.TransformerEncoder``'s inference fast path hands its layers (a strided
    NestedTensor built by ``torch._nested_tensor_from_mask``); jagged tensors work the same.
    Weights, when asked for, come back padded: (B, L_max, S_max), zero at padding.

    Raises:
        ValueError: key/value not nested like the query, a mask given (the nested lengths
            are the padding), ``batch_first=False``, or lengths/batch sizes that disagree.
    """
    key = default(key, query)
    value = default(value, key)
    if not module.batch_first:
        raise ValueError(
            "nested input needs batch_first=True (a nested tensor is (batch, length*, "
            "embed_dim)), got a module with batch_first=False"
        )
    for name, t in (("key", key), ("value", value)):
        checks.check_tensor(name, t)
        if not t.is_nested:
            raise ValueError(
                f"{name} must be a nested tensor when query is one, got a regular tensor of "
                f"shape {tuple(t.shape)}"
            )
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if mask is not None:
            raise ValueError(
                f"{name} must be None for nested input (the nested lengths mark the padding); "
                "pass padded tensors to use masks"
            )
    (q, q_lens), (k, k_lens), (v, v_lens) = (_to_padded(n, t) for n, t in
                                             (("query", query), ("key", key), ("value", value)))
    if not len(q_lens) == len(k_lens) == len(v_lens):
        raise ValueError(
            f"query, key and value must have the same batch size, got {len(q_lens)}, "
            f"{len(k_lens)} and {len(v_lens)}"
        )
    if k_lens != v_lens:
        raise ValueError(f"key and value must have the same lengths, got {k_lens} and {v_lens}")
    slots = torch.arange(k.shape[1], device=k.device)
    key_padding = slots >= torch.tensor(k_lens, device=k.device)[:, None]  # (b, j)
    out, weights = module.forward(  # not module(...): the hooks already ran for this call
        q, k, v, key_padding_mask=key_padding, need_weights=need_weights,
        average_attn_weights=average_attn_weights, is_causal=is_causal,
        **({} if positions is None else {"positions": positions}),  # (b, max l[, a]) padded
    )
    if weights is not None:
        rows = torch.arange(q.shape[1], device=q.device)
        query_padding = rows >= torch.tensor(q_lens, device=q.device)[:, None]  # (b, i)
        shape = (-1, q.shape[1], 1) if weights.dim() == 3 else (-1, 1, q.shape[1], 1)
        weights = weights.masked_fill(query_padding.view(shape), 0.0)
    return _to_nested(out, q_lens, query.layout), weights


def _to_padded(name: str, t: Tensor) -> tuple[Tensor, list[int]]:
    """Nested (B, j*, D) -> padded (B, max j, D) with zeros, and the B lengths."""
    if t.dim() != 3:
        raise ValueError(
            f"nested {name} must be 3-D (batch, length*, embed_dim), got {t.dim()}-D"
        )
    lengths = [part.shape[0] for part in t.unbind()]
    return t.to_padded_tensor(0.0), lengths


def _to_nested(x: Tensor, lengths: list[int], layout: torch.layout) -> Tensor:
    """Padded (B, L, D) -> nested (B, j*, D) of ``layout`` keeping each sample's length."""
    return torch.nested.as_nested_tensor(
        [x[b, :n] for b, n in enumerate(lengths)], layout=layout
    )
