"""Cheap input checks of the public kernel entry points (see docs/decisions.md, "Kernels").

The layers check their input at their own boundary and call the kernels' unchecked bodies;
a direct call of a public kernel function goes through these instead. Shapes, dtypes and
devices cost O(1); ids and offsets are read once (O(E) or O(b)), as
:func:`mmattn._checks.check_range` does.
"""

from __future__ import annotations

from torch import Tensor

from mmattn import _checks as checks


def check_heads(q: object, k: object, v: object, layout: str) -> None:
    """Head-split ``q``, ``k``, ``v`` that fit together: ``layout`` is ``"(n, h, e)"`` (rows)
    or ``"(b, h, l, e)"`` (a padded batch); ``k`` and ``v`` share their rows and heads, the
    key heads divide the query heads, query and key share the head width.

    Raises:
        TypeError: not floating tensors, or of different dtypes.
        ValueError: another rank, rows, heads or width; another device.
    """
    rank = layout.count(",") + 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t)
        checks.check_floating(name, t)
        checks.check_rank(name, t, (rank,), layout)
    checks.check_same_dtype("k", k, "q", q)
    checks.check_same_dtype("v", v, "q", q)
    checks.check_same_device("k", k, "q", q)
    checks.check_same_device("v", v, "q", q)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k and v must have the same rows and heads {layout}, got k {tuple(k.shape)} and "
            f"v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head width e, got q {tuple(q.shape)} and k "
            f"{tuple(k.shape)}"
        )
    if rank == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(
            f"q and k must have the same batch size, got q {tuple(q.shape)} and k "
            f"{tuple(k.shape)}"
        )
    heads, kv_heads = q.shape[1], k.shape[1]  # the head axis of both layouts
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"the key/value heads must divide the query heads (grouped-query attention), got "
            f"{heads} query heads and {kv_heads} key/value heads"
        )


def check_key_mask(key_mask: object, shape: tuple, like: Tensor, layout: str) -> None:
    """None, or a bool ("real key") / floating (added) mask of ``shape`` on ``like``'s device.

    Raises:
        TypeError: not a tensor, or an integer mask (0/1 added would not mask anything).
        ValueError: another shape or device.
    """
    if key_mask is None:
        return
    checks.check_tensor("key_mask", key_mask)
    checks.check_mask_dtype("key_mask", key_mask)
    checks.check_shape("key_mask", key_mask, shape, layout)
    checks.check_same_device("key_mask", key_mask, "q", like)


def check_options(dropout_p: object, scale: object, need_weights: object) -> None:
    """``dropout_p`` in [0, 1), ``scale`` None or a finite number, ``need_weights`` a bool."""
    checks.check_probability("dropout_p", dropout_p)
    if scale is not None:
        checks.check_number("scale", scale)
    checks.check_bool("need_weights", need_weights)
