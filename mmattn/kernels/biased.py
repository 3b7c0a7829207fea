"""Attention with an additive score bias (a learned table, a shift mask): the window kernel.

Axis key: ``b`` batch (any leading axes: ``b w`` for windows), ``h`` heads, ``i``/``j``
query/key length, ``e`` head width.

``out = softmax(q kᵀ · scale + bias) v``, on the two paths of :mod:`mmattn.kernels.dense`:
the fused one (``F.scaled_dot_product_attention`` with the bias as its float mask) and the
explicit twin (:func:`~mmattn.kernels.dense.dot_scores`, the bias added, then
:func:`~mmattn.kernels.dense.softmax_attend`). Swin's windows are where it runs: torchvision's
and timm's window attention after :func:`mmattn.replace_attention`.

A bias without ``-inf`` (``finite=True``: a table plus Swin's ``-100`` shift mask) leaves no
row without a key, so the dead-row guard is skipped on both paths; with ``finite=False`` the
one dead-row policy of :mod:`mmattn.kernels.dense` applies (a row with no allowed key gives
zeros).

Which path. The switch (``MMATTN_FUSED_ATTN=0``) and ``need_weights`` force the explicit one,
as everywhere. Otherwise the CPU runs the explicit one too: torch's CPU SDPA is 1.4 to 2×
slower than the twin on Swin's 49-token windows with a bias that broadcasts over the batch or
needs a gradient (the math fallback; docs/decisions.md has the measurements), and a
swapped Swin must not be slower than stock. Other devices run the fused one (there the
memory-efficient kernel takes the bias and its gradient).
"""

from __future__ import annotations

from torch import Tensor

from mmattn.kernels import dense as _dense
from mmattn.kernels._scores import default_scale
from mmattn.kernels.dense import dot_scores, report, reporting, sdpa, softmax_attend

__all__ = ["biased_attend"]

_CPU_REASON = (
    "on the CPU a score bias runs the explicit twin: SDPA with a broadcast or learned float "
    "mask is slower there (mmattn.kernels.biased)"
)


def biased_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    *,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    finite: bool = True,
    fused: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``softmax(q kᵀ · scale + bias) v`` and, on request, the weights (unchecked).

    Args:
        q, k, v: queries, keys, values with the same heads and leading axes.
        bias: float, added to the scores, broadcastable to (..., h, i, j).
        dropout_p: dropout on the weights (the caller passes 0 in eval mode).
        scale: score scale; default ``1 / sqrt(e)``.
        need_weights: also return the weights (explicit path).
        finite: the caller's promise that ``bias`` holds no ``-inf`` (no dead rows).
        fused: force the fused (True) or explicit (False) path; default: see the module
            docstring.

    Shape:
        - q: (..., h, i, e); k: (..., h, j, e); v: (..., h, j, e_v); bias broadcastable to
          (..., h, i, j)
        - returns: (..., h, i, e_v) and the weights (..., h, i, j) or None
    """
    scale = default_scale(q, scale)
    reasons = _dense.explicit_reasons(need_weights)
    if fused is None:
        if not reasons and q.device.type == "cpu":
            reasons.append(_CPU_REASON)
        fused = not reasons
    elif need_weights:
        fused = False
    if reporting():
        report(
            "fused" if fused else "explicit", [] if fused else reasons, q=q, k=k, v=v,
            mask=bias, dropout_p=dropout_p, is_causal=False, scale=scale,
        )
    if fused:
        out = sdpa(q, k, v, bias, dropout_p=dropout_p, scale=scale, dead_rows=not finite)
        return out, None
    scores = dot_scores(q, k, scale)
    if finite:  # no row to open: add the bias here, the twin then needs no mask
        in_place = not scores.requires_grad and not bias.requires_grad
        scores = scores.add_(bias) if in_place else scores + bias
        out, weights = softmax_attend(scores, v, None, dropout_p)
    else:
        out, weights = softmax_attend(scores, v, bias, dropout_p)
    return out, (weights if need_weights else None)
