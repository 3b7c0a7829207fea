"""Input checks of the packed attention path (see :mod:`mmattn.attention._packed`).

Every check raises ``ValueError`` or ``TypeError`` naming the argument and the expected vs
actual value. Attribute reads on a nested tensor go through ``__torch_function__``, so the
checks read the nested tensor's own fields once and check the packed rows otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmattn import _checks as checks
from mmattn.kernels.packed import is_jagged

PADDED_ALTERNATIVE = (
    "use is_causal=True for the causal rule, LocalAttention for a band, or Tokens.unpack() "
    "and pass attn_mask with the padded batch"
)


def check_packed(module, query, key, value, key_padding_mask) -> None:
    """Mixing, rank, width, dtype and device checks for a packed call."""
    names = ("query", "key", "value")
    tensors = (query, key, value)
    packed = [name for name, t in zip(names, tensors) if is_jagged(t)]
    padded = [name for name, t in zip(names, tensors) if not is_jagged(t)]
    if padded:
        raise TypeError(
            f"{' and '.join(packed)} {'is' if len(packed) == 1 else 'are'} packed (jagged "
            f"nested) but {' and '.join(padded)} {'is' if len(padded) == 1 else 'are'} "
            "padded; pass all packed (Tokens.pack()) or all padded (Tokens.unpack())"
        )
    for name, t in zip(names, tensors):
        checks.check_packed_has_data(name, t)
        if t._ragged_idx != 1 or len(t._size) != 3:
            raise ValueError(
                f"{name} must be a packed (batch, length*, dim) jagged tensor, got shape "
                f"{tuple(t.shape)}"
            )
        if t._size[0] != query._size[0]:
            raise ValueError(
                f"query, key and value must have the same batch size, got query "
                f"{query._size[0]} and {name} {t._size[0]}"
            )
    if key_padding_mask is not None:
        raise ValueError(
            "key_padding_mask must be None for packed (jagged) input: a packed batch has no "
            "padding; leave the padded keys out of the packed key instead"
        )


def check_values(module, qv: Tensor, kv: Tensor, vv: Tensor) -> None:
    """Width, dtype and device of the packed rows (cheaper than asking the nested tensors)."""
    for name, t, width, what in (
        ("query", qv, module.embed_dim, "embed_dim"),
        ("key", kv, module.kdim, "kdim"),
        ("value", vv, module.vdim, "vdim"),
    ):
        checks.check_floating(name, t)
        if t.shape[-1] != width:
            raise ValueError(
                f"{name} must have last dimension {what}={width}, got shape "
                f"(batch, length*, {t.shape[-1]})"
            )
    for name, t in (("key", kv), ("value", vv)):
        checks.check_same_dtype(name, t, "query", qv)
        checks.check_same_device(name, t, "query", qv)
    weight = module.q_proj.weight
    checks.check_same_device("query", qv, "the module's parameters", weight)
    if qv.dtype != weight.dtype and not torch.is_autocast_enabled():
        raise TypeError(
            f"query has dtype {qv.dtype} but the module's parameters have dtype "
            f"{weight.dtype}; convert one of them (e.g. module.to({qv.dtype}))"
        )


def check_attn_mask(module, attn_mask, q_lens, k_lens, query) -> Tensor | None:
    """attn_mask for a packed batch: (max i, max j) or (b·h, max i, max j), else ValueError."""
    if attn_mask is None:
        return None
    checks.check_tensor("attn_mask", attn_mask)
    checks.check_mask_dtype("attn_mask", attn_mask)
    checks.check_same_device("attn_mask", attn_mask, "query", query)
    rows, cols = max(q_lens, default=0), max(k_lens, default=0)
    stacked = len(q_lens) * module.num_heads
    if tuple(attn_mask.shape) not in ((rows, cols), (stacked, rows, cols)):
        raise ValueError(
            f"attn_mask cannot apply to this packed batch: it must have shape {(rows, cols)} "
            f"or {(stacked, rows, cols)} (the padded batch's mask, applied to each item's "
            f"top-left corner), got {tuple(attn_mask.shape)}; {PADDED_ALTERNATIVE}"
        )
    if not attn_mask.is_floating_point():
        return attn_mask
    return attn_mask.to(query.dtype)

