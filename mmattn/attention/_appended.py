"""Keys appended to every sequence: ``add_bias_kv``'s learned pair and ``add_zero_attn``'s zeros.

Axis key: ``b`` batch, ``k`` key/value heads, ``i``/``j`` query/key length, ``e`` head width.
One home for the padded path (:func:`append_keys`) and the packed runner
(:func:`num_extra_keys`, :func:`extra_keys`), so both append the same keys in the same order.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn

from mmattn.masks import causal_mask


def num_extra_keys(module: nn.Module) -> int:
    """How many keys ``add_bias_kv`` and ``add_zero_attn`` append to every item."""
    return int(module.bias_k is not None) + int(bool(module.add_zero_attn))


def extra_keys(module: nn.Module, e: int, dtype, device) -> tuple[Tensor | None, Tensor | None]:
    """The keys/values appended to every item: ``bias_k``/``bias_v``, then the zero key.

    Shape:
        - returns: (1, k, extra, e) each, or None
    """
    keys, values = [], []
    heads = module.num_kv_heads
    if module.bias_k is not None:
        keys.append(rearrange(module.bias_k, "1 1 (k e) -> 1 k 1 e", e=e))
        values.append(rearrange(module.bias_v, "1 1 (k e) -> 1 k 1 e", e=e))
    if module.add_zero_attn:
        keys.append(torch.zeros(1, heads, 1, e, dtype=dtype, device=device))
        values.append(torch.zeros(1, heads, 1, e, dtype=dtype, device=device))
    if not keys:
        return None, None
    return torch.cat(keys, dim=2).to(dtype), torch.cat(values, dim=2).to(dtype)


def append_keys(
    module: nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, bool]:
    """Append the extra keys to padded k/v and one always-allowed column to the masks.

    The causal rule covers the real keys; appended keys stay visible, as in torch, so a
    causal call folds the rule into ``attn_mask`` first.

    Shape:
        - q: (b, h, i, e); k, v: (b, k, j, e) -> (b, k, j + extra, e)
        - masks in the module direction (True = not allowed)
    """
    if not num_extra_keys(module):
        return k, v, key_padding_mask, attn_mask, is_causal
    if is_causal:
        attn_mask = _fold_causal(attn_mask, q.shape[2], k.shape[2], q.device)
        is_causal = False
    if module.bias_k is not None:
        bias_k, bias_v = (
            rearrange(b.to(k.dtype), "1 1 (h e) -> 1 h 1 e", h=module.num_kv_heads)
            .expand(q.shape[0], -1, -1, -1)
            for b in (module.bias_k, module.bias_v)
        )
        k, v = torch.cat([k, bias_k], dim=2), torch.cat([v, bias_v], dim=2)
        key_padding_mask, attn_mask = _pad_masks(key_padding_mask, attn_mask)
    if module.add_zero_attn:
        k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[3])], dim=2)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], dim=2)
        key_padding_mask, attn_mask = _pad_masks(key_padding_mask, attn_mask)
    return k, v, key_padding_mask, attn_mask, is_causal


def _pad_masks(
    key_padding_mask: Tensor | None, attn_mask: Tensor | None
) -> tuple[Tensor | None, Tensor | None]:
    """Append one always-allowed key column to module-direction masks."""
    return tuple(
        None if m is None else torch.cat([m, m.new_zeros(*m.shape[:-1], 1)], dim=-1)
        for m in (key_padding_mask, attn_mask)
    )


def _fold_causal(
    attn_mask: Tensor | None, q_len: int, k_len: int, device: torch.device
) -> Tensor:
    """Merge the causal rule into a module-direction ``attn_mask`` (True = not allowed)."""
    hidden = ~causal_mask(q_len, k_len, device=device)
    if attn_mask is None:
        return hidden
    if attn_mask.dtype == torch.bool:
        return attn_mask | hidden
    return attn_mask.masked_fill(hidden, float("-inf"))
