"""Scores of the explicit path: ``q kᵀ · scale`` in one ``baddbmm``, Bahdanau's additive
scores (:class:`mmattn.AdditiveAttention`), and the grouped-query fold of a mask
(re-exported by :mod:`mmattn.kernels.dense`, where the explicit path lives).

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``g`` query heads per key
head, ``i`` query length, ``j`` key length, ``e`` head width.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext

import torch
from einops import rearrange
from torch import Tensor

from mmattn._helpers import static_int


def acc_dtype(q: Tensor) -> torch.dtype:
    """The dtype scores and sums are kept in: float32, or float64 for double inputs."""
    return torch.promote_types(q.dtype, torch.float32)


def default_scale(q: Tensor, scale: float | None) -> float:
    """``scale``, or the default ``1 / sqrt(e)`` of q's head width (1 when e = 0): the one
    default every kernel and engine uses.

    Shape:
        - q: (..., e)
    """
    if scale is not None:
        return scale
    # the head width as a plain int: a traced width (torch.compile(dynamic=True) makes the
    # embedding width symbolic) would put a symbolic sqrt into a guard, which torch 2.5's
    # guard printer cannot write ("name 'OpaqueUnaryFn_sqrt' is not defined")
    width = static_int(q.shape[-1])
    return 1.0 / math.sqrt(width) if width else 1.0


def dot_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """q kᵀ · scale from one ``baddbmm`` with the scale folded in.

    Half-precision inputs get float32 scores, as the fused kernels keep them, so large
    activations neither overflow nor lose the ranking of close scores.

    Shape:
        - q: (..., i, e); k: (..., j, e)
        - returns: (..., i, j)
    """
    *lead, q_len, width = q.shape
    k_len = k.shape[-2]
    q3 = q.reshape(-1, q_len, width)  # ((b h), i, e)
    k3 = k.reshape(-1, k_len, width)  # ((b h), j, e)
    if q.dtype in (torch.float16, torch.bfloat16):
        q3, k3 = q3.float(), k3.float()
    # Autocast would cast baddbmm back to half precision: keep the float32 scores.
    with _no_autocast(q.device.type):
        scores = torch.baddbmm(
            q3.new_empty(()).expand(q3.shape[0], q_len, k_len),
            q3,
            k3.transpose(1, 2),
            beta=0.0,
            alpha=scale,
        )
    return scores.view(*lead, q_len, k_len)


def additive_scores(q: Tensor, k: Tensor, weight: Tensor) -> Tensor:
    r"""Bahdanau scores :math:`s_{ij} = \sum_e w_{he} \tanh(q_{ie} + k_{je})` per head.

    Args:
        q: projected queries :math:`W_q q`. k: projected keys :math:`W_k k`.
        weight: the score vector ``w`` of each head.

    Shape:
        - q: (b, h, i, e); k: (b, k, j, e) with ``k`` dividing ``h`` (grouped-query
          attention: query head ``n`` pairs with key head ``n // (h / k)``); weight: (h, e)
        - returns: (b, h, i, j)
    """
    groups = q.shape[1] // k.shape[1]
    qg = rearrange(q, "b (k g) i e -> b k g i e", g=groups)
    hidden = torch.tanh(qg[:, :, :, :, None, :] + k[:, :, None, None, :, :])  # (b k g i j e)
    # "(k g) e -> k g e", not through einops: a Parameter would join einops' backend cache
    # on the first eager call and so change a guard of every compiled graph (a recompile)
    weight = weight.unflatten(0, (k.shape[1], groups))
    scores = torch.einsum("bkgije,kge->bkgij", hidden, weight)
    return rearrange(scores, "b k g i j -> b (k g) i j")


def _no_autocast(device_type: str) -> AbstractContextManager:
    """Autocast switched off on the devices that have it (a no-op elsewhere, e.g. meta)."""
    if device_type in ("cpu", "cuda"):
        return torch.autocast(device_type, enabled=False)
    return nullcontext()


def group_mask(mask: Tensor, groups: int, q_len: int) -> Tensor:
    """Fold a (b, h, i, j)-broadcastable mask to (b, k | 1, (g i) | 1, j) for grouped queries.

    The query heads of one key head are laid along the query axis (``b (k g) i e -> b k (g
    i) e``), so the mask must follow: a mask shared by the heads repeats over ``g``; a
    per-head mask is regrouped. A mask with one row for all queries stays as it is.
    """
    if mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    heads, rows = mask.shape[1], mask.shape[2]
    if heads == 1:
        return mask if rows == 1 else mask.repeat(1, 1, groups, 1)
    mask = mask.expand(-1, -1, q_len, -1)
    if groups == 1:
        return mask
    # b (k g) i j -> b k (g i) j by concatenation: a reshape would guard on the strides of
    # an (L, L) term, which torch.export cannot prove for a symbolic length
    return torch.cat(mask.unflatten(1, (-1, groups)).unbind(2), dim=2)
