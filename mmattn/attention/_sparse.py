"""``attn_mask=SparseMask``: a compiled pattern on MultiHeadAttention, block-sparse.

Axis key: ``b`` batch, ``h`` heads, ``l`` length (query = key), ``d`` model width, ``e``
head width.

``MultiHeadAttention.forward`` hands a :class:`~mmattn.patterns.SparseMask` here. The call
is the module's own (projections, ``position``, ``key_padding_mask``, ``is_causal``,
dropout, weights), with the attention step run by :mod:`mmattn.kernels.block_sparse` over
the mask's non-empty tiles; it equals the module with ``attn_mask=(~mask.dense())
.repeat_interleave(num_heads, 0)``, score modifiers included (ALiBi on the token index).

A layer says whether it takes a SparseMask with the class attribute ``takes_sparse_mask``
(default: whether it keeps MultiHeadAttention's plain attention step); layers with their own
geometry (local band, neighbourhood, edges, additive or low-rank scores) and
cross-attention raise a TypeError naming ``attn_mask``.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from mmattn._helpers import exporting
from mmattn.attention._appended import num_extra_keys
from mmattn.attention._inputs import from_batch_first, to_batch_first
from mmattn.attention._modifiers import score_modifiers
from mmattn.attention._positions import check_positions, rotate
from mmattn.kernels import _routes, block_sparse, dense
from mmattn.kernels.packed import is_jagged
from mmattn.patterns import SparseMask


def is_sparse_mask(value: object) -> bool:
    """True for a compiled pattern (:class:`~mmattn.patterns.SparseMask`)."""
    return isinstance(value, SparseMask)


def takes_sparse_mask(module: nn.Module) -> bool:
    """Whether ``module`` runs a SparseMask (its class's ``takes_sparse_mask``, default:
    whether it keeps MultiHeadAttention's plain attention step)."""
    takes = getattr(type(module), "takes_sparse_mask", None)
    if takes is None:
        plain = getattr(module, "_plain_attention", None)
        takes = bool(plain()) if callable(plain) else False
    return takes


def reject_sparse_mask(module: nn.Module, attn_mask: object) -> None:
    """Raise a TypeError naming ``attn_mask`` when ``module`` cannot run a SparseMask."""
    if not is_sparse_mask(attn_mask):
        return
    if not takes_sparse_mask(module):
        name = type(module).__name__
        raise TypeError(
            f"attn_mask: {name} does not take a SparseMask (a compiled pattern runs on "
            "MultiHeadAttention self-attention; this layer has its own geometry or attends "
            "a context); give it a tensor mask (~mask.dense()) or use MultiHeadAttention"
        )


def _check_call(
    module: nn.Module, query: Any, key: Any, value: Any, mask: SparseMask, cache: Any
) -> None:
    reject_sparse_mask(module, mask)
    if (key is not None and key is not query) or (value is not None and value is not key
                                                  and value is not query):
        raise TypeError(
            "attn_mask: a SparseMask is a self-attention pattern (L == S): call the module "
            "with key and value None (or the query itself), not on another sequence"
        )
    if exporting():
        raise NotImplementedError(
            "attn_mask=SparseMask does not export: its tile plan is data, not a tensor. "
            "Export the module with attn_mask=~mask.dense() (a tensor input) instead"
        )
    if cache is not None:
        raise ValueError("attn_mask: a SparseMask does not take cache= (decode without it)")
    if num_extra_keys(module):
        raise ValueError(
            "attn_mask: a SparseMask does not combine with add_bias_kv / add_zero_attn (they "
            "append keys the pattern does not cover)"
        )
    if is_jagged(query) or (isinstance(query, Tensor) and query.is_nested):
        raise ValueError(
            "attn_mask: a SparseMask runs on padded input; pass tokens.unpack().x with the "
            "mask compiled on the same Tokens"
        )


def sparse_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    key_padding_mask: Tensor | None,
    need_weights: bool,
    attn_mask: SparseMask,
    average_attn_weights: bool,
    is_causal: bool,
    cache: Any = None,
    positions: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``module.forward`` with ``attn_mask`` a SparseMask (see the module docstring)."""
    _check_call(module, query, key, value, attn_mask, cache)
    batched = module._check_inputs(query, query, query, key_padding_mask, None, is_causal)
    query, _, _, key_padding_mask = to_batch_first(
        module, batched, query, query, query, key_padding_mask
    )
    batch, length = query.shape[0], query.shape[1]
    if attn_mask.shape != (batch, length, length):
        raise ValueError(
            f"attn_mask: the SparseMask was compiled for shape {attn_mask.shape} (B, L, L), "
            f"but this call has batch {batch} and length {length}; compile the pattern on "
            "the Tokens of this call"
        )
    if attn_mask.device != query.device:
        raise ValueError(
            f"attn_mask: the SparseMask is on device {attn_mask.device} but query is on "
            f"{query.device}; use mask.to(device)"
        )
    positions = check_positions(
        module, positions, batch if batched else None, length, query
    )
    q = rearrange(module.q_proj(query), "b l (h e) -> b h l e", h=module.num_heads)
    k, v = module._project_kv(query, query)
    q, k = rotate(module, q, k, 0 if positions is None else positions)
    key_mask = None
    if key_padding_mask is not None:
        key_mask = ~key_padding_mask if key_padding_mask.dtype == torch.bool else (
            key_padding_mask.to(q.dtype))
    out, weights = module._step(
        _attend, q, k, v, attn_mask, module.embed_dim, key_mask=key_mask, is_causal=is_causal,
        dropout_p=module.dropout if module.training else 0.0, need_weights=need_weights,
        groups=module.num_heads // module.num_kv_heads, modifiers=score_modifiers(module),
    )
    out = module.out_proj(rearrange(out, "b h l e -> b l (h e)"))
    return from_batch_first(module, batched, out, weights, average_attn_weights)


@torch.compiler.disable
def _attend(q: Tensor, k: Tensor, v: Tensor, mask: SparseMask, width: int,
            **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """The kernel on the mask's cached plan, run eagerly: under torch.compile a graph break
    (the plan is data: Python lists of buckets), so the projections around it compile. On
    CUDA an engine takes the call first (:mod:`mmattn.kernels.engines`: flex with the mask's
    BlockMask, varlen for segment-wise patterns). B = 0 or L = 0 gives the empty result
    (docs/edge_cases.md), without a plan or an engine."""
    if not q.shape[0] or not q.shape[2]:  # the dense kernel's zeros, attached to autograd
        return dense.attend(q, k, v, None, need_weights=kwargs["need_weights"],
                            groups=kwargs["groups"])
    out, choice = _routes.sparse(q, k, v, mask, **kwargs)
    if out is not None:
        return out, None
    with _routes.fallback_facts(choice):
        return block_sparse.attend(q, k, v, mask.plan(width), **kwargs)
