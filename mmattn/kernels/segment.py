"""Attention along the edges of a graph: segment softmax over edge lists, in O(E).

Axis key: ``n`` query rows (flat tokens), ``m`` key rows, ``E`` edges, ``h`` query heads,
``k`` key/value heads (grouped-query attention, ``h = k * g``), ``g`` query heads per key
head, ``e`` head width, ``f`` value head width.

An edge ``(src, dst)`` lets query row ``dst`` attend key row ``src``. For every edge the
score is :math:`s = q_{dst} \\cdot k_{src} / \\sqrt{e}` (+ an edge bias); the softmax runs
over the edges of each query (a segment softmax: ``scatter_reduce`` max, ``exp``,
``index_add_``), and the result is the weighted sum of the values of those edges. A query
with no edge gets zeros, never NaN. Nothing here checks its input; the layer
(:class:`mmattn.EdgeAttention`) validates and prepares the edge set with :func:`edge_set`.

Two paths compute the same numbers:

- the default (``MMATTN_FUSED_ATTN=1``): :class:`EdgeAttend`, an ``autograd.Function`` that
  works on chunks of edges and keeps only the (E, h) probabilities for backward; the
  gathered (E, h, e) queries, keys and values are rebuilt chunk by chunk in backward, so
  peak memory is O(E·h + chunk·h·e) on top of the node tensors;
- the explicit twin :func:`edge_attend_explicit`: the formula written out with autograd (it
  keeps every gathered tensor: O(E·h·e)), which also returns the weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn.kernels.dense import explicit_reasons, report, reporting, use_fused_attn

__all__ = ["EdgeAttend", "edge_attend", "edge_attend_explicit", "edge_set"]

#: Elements of one gathered (chunk, h, e) block: big enough to amortise the Python loop,
#: small enough to stay in cache.
CHUNK_ELEMENTS = 1 << 21


def edge_set(
    src: Tensor,
    dst: Tensor,
    num_keys: int,
    *,
    loops: tuple[Tensor, Tensor] | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """Unique edges sorted by (dst, src), with self loops, and the bias that follows them.

    A loop is added only where the same pair is not already an edge (the edge keeps its
    bias; an added loop gets bias 0).

    Args:
        src, dst: key and query row of every edge.
        num_keys: number of key rows (for the sort key ``dst * num_keys + src``).
        loops: (src, dst) of the self loops to add, or None.
        bias: (E, h) scores added per edge, or None.

    Returns:
        ``(src, dst, bias, duplicates)``; ``duplicates`` tells whether the given edges held
        one pair twice (an edge bias is then ambiguous; the caller raises).
    """
    num_given = src.shape[0]
    if loops is not None:
        src = torch.cat([src, loops[0]])
        dst = torch.cat([dst, loops[1]])
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(loops[0].shape[0], bias.shape[1])])
    key = dst * num_keys + src
    key, order = torch.sort(key, stable=True)  # a given edge sorts before its added loop
    first = torch.ones_like(key, dtype=torch.bool)
    first[1:] = key[1:] != key[:-1]
    duplicates = bool((~first & (order < num_given)).any()) if key.numel() else False
    order = order[first]
    src, dst = src[order], dst[order]
    if bias is not None:
        bias = bias[order]
    return src, dst, bias, duplicates


def _segment_softmax(scores: Tensor, dst: Tensor, num_queries: int) -> Tensor:
    """softmax of ``scores`` over the edges of each query (float32); dead rows give 0.

    Shape:
        - scores: (E, ...) float32; dst: (E,); returns (E, ...)
    """
    with torch.no_grad():  # the softmax does not depend on the shift: no gradient through it
        shape = (num_queries, *scores.shape[1:])
        index = dst.view(-1, *([1] * (scores.dim() - 1))).expand_as(scores)
        peak = scores.new_full(shape, -math.inf).scatter_reduce_(0, index, scores, "amax")
        peak = torch.where(torch.isneginf(peak), 0.0, peak)
    p = torch.exp(scores - peak.index_select(0, dst))
    total = p.new_zeros(shape).index_add_(0, dst, p)
    total = torch.where(total > 0, total, 1.0)  # a query whose every score is -inf: zeros
    return p / total.index_select(0, dst)


def edge_attend_explicit(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    src: Tensor,
    dst: Tensor,
    *,
    bias: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The readable twin: gather, score, segment softmax, weighted ``index_add_``.

    Shape:
        - q: (n, h, e); k: (m, k, e); v: (m, k, f); src, dst: (E,); bias: (E, h)
        - returns: (n, h, f) and the weights (E, h) (before dropout)
    """
    groups = q.shape[1] // max(k.shape[1], 1)
    scale = _scale(q, scale)
    acc = _acc(q)
    k = k.repeat_interleave(groups, dim=1)  # (m, h, e): query head n uses key head n // g
    v = v.repeat_interleave(groups, dim=1)
    scores = (q[dst].to(acc) * k[src].to(acc)).sum(-1) * scale  # (E, h)
    if bias is not None:
        scores = scores + bias.to(acc)
    weights = _segment_softmax(scores, dst, q.shape[0])
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=acc)
    out = out.index_add(0, dst, dropped[..., None] * v[src].to(acc))
    return out.to(q.dtype), weights


def _acc(q: Tensor) -> torch.dtype:
    """The dtype scores and sums are kept in: float32, or float64 for double inputs."""
    return torch.promote_types(q.dtype, torch.float32)


def _scale(q: Tensor, scale: float | None) -> float:
    if scale is not None:
        return scale
    return 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0


def _chunks(num_edges: int, width: int) -> list[slice]:
    step = max(1024, CHUNK_ELEMENTS // max(width, 1))
    return [slice(start, start + step) for start in range(0, num_edges, step)]


class EdgeAttend(torch.autograd.Function):
    """Edge attention that saves only the (E, h) probabilities (and the dropout mask).

    Forward and backward walk the edges in chunks: each chunk gathers its rows of q, k and
    v (and of the output gradient), so no (E, h, e) tensor ever exists whole. The softmax
    and its backward run on the (E, h) scores in float32 (float64 for double inputs); so do
    the accumulators, which are cast back to the input dtype at the end.

    Call it through :func:`edge_attend`; ``apply(q, k, v, bias, src, dst, scale,
    dropout_p)`` with q (n, h, e), k (m, k, e), v (m, k, f), bias (E, h) or None.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, src, dst, scale, dropout_p):  # noqa: D102
        n, heads, width = q.shape
        m, kv_heads, _ = k.shape
        groups, acc = heads // kv_heads, _acc(q)
        num_edges = src.shape[0]
        qg = q.reshape(n, kv_heads, groups, width)
        scores = q.new_empty(num_edges, kv_heads, groups, dtype=acc)
        for part in _chunks(num_edges, heads * width):
            qd = qg.index_select(0, dst[part]).to(acc)  # (c, k, g, e)
            ks = k.index_select(0, src[part]).to(acc)  # (c, k, e)
            scores[part] = torch.einsum("ckge,cke->ckg", qd, ks)
        scores.mul_(scale)
        if bias is not None:
            scores += bias.reshape(num_edges, kv_heads, groups).to(acc)
        weights = _segment_softmax(scores, dst, n)
        keep = None
        dropped = weights
        if dropout_p > 0:
            keep = torch.rand_like(weights) >= dropout_p
            dropped = weights * keep / (1.0 - dropout_p)
        out = _aggregate(dropped, v, src, dst, n)
        ctx.save_for_backward(q, k, v, src, dst, weights, keep)
        ctx.scale, ctx.dropout_p, ctx.has_bias = scale, dropout_p, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.reshape(n, heads, v.shape[-1]).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, src, dst, weights, keep = ctx.saved_tensors
        n, heads, width = q.shape
        m, kv_heads, _ = k.shape
        groups, acc = heads // kv_heads, _acc(q)
        num_edges, value_width = src.shape[0], v.shape[-1]
        grad = grad_out.reshape(n, kv_heads, groups, value_width)
        dropped = weights if keep is None else weights * keep / (1.0 - ctx.dropout_p)
        d_weights = weights.new_empty(weights.shape)
        grad_v = torch.zeros(m, kv_heads, value_width, dtype=acc, device=v.device)
        for part in _chunks(num_edges, heads * max(width, value_width)):
            gd = grad.index_select(0, dst[part]).to(acc)  # (c, k, g, f)
            vs = v.index_select(0, src[part]).to(acc)  # (c, k, f)
            d_weights[part] = torch.einsum("ckgf,ckf->ckg", gd, vs)
            grad_v.index_add_(0, src[part], torch.einsum("ckg,ckgf->ckf", dropped[part], gd))
        if keep is not None:
            d_weights = d_weights * keep / (1.0 - ctx.dropout_p)
        # softmax backward per query: ds = p * (dp - sum_edges p * dp)
        row = torch.zeros(n, kv_heads, groups, dtype=acc, device=q.device)
        row.index_add_(0, dst, weights * d_weights)
        d_scores = weights * (d_weights - row.index_select(0, dst))
        grad_q = grad_k = None
        need_q, need_k = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_q or need_k:
            qg = q.reshape(n, kv_heads, groups, width)
            grad_q = torch.zeros(n, kv_heads, groups, width, dtype=acc,
                                 device=q.device)
            grad_k = torch.zeros(m, kv_heads, width, dtype=acc, device=k.device)
            scaled = d_scores * ctx.scale
            for part in _chunks(num_edges, heads * width):
                ds = scaled[part]
                ks = k.index_select(0, src[part]).to(acc)  # (c, k, e)
                grad_q.index_add_(0, dst[part], ds[..., None] * ks[:, :, None])
                qd = qg.index_select(0, dst[part]).to(acc)  # (c, k, g, e)
                grad_k.index_add_(0, src[part], torch.einsum("ckg,ckge->cke", ds, qd))
            grad_q = grad_q.reshape(n, heads, width).to(q.dtype)
            grad_k = grad_k.to(k.dtype)
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = d_scores.reshape(num_edges, heads).to(ctx.bias_dtype)
        return grad_q, grad_k, grad_v.to(v.dtype), grad_bias, None, None, None, None


def _aggregate(weights: Tensor, v: Tensor, src: Tensor, dst: Tensor, n: int) -> Tensor:
    """(n, k, g, f) float32: sum over the edges of each query of weight · value, chunked."""
    num_edges, kv_heads, groups = weights.shape
    acc = weights.dtype
    out = torch.zeros(n, kv_heads, groups, v.shape[-1], dtype=acc, device=v.device)
    for part in _chunks(num_edges, kv_heads * groups * v.shape[-1]):
        vs = v.index_select(0, src[part]).to(acc)  # (c, k, f)
        out.index_add_(0, dst[part], weights[part][..., None] * vs[:, :, None])
    return out


def edge_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    src: Tensor,
    dst: Tensor,
    *,
    bias: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention along edges: the memory-lean :class:`EdgeAttend` or the explicit twin.

    The explicit twin runs when weights are requested or ``MMATTN_FUSED_ATTN=0``.

    Args:
        q, k, v: query rows and key/value rows, head-split; ``k``/``v`` may have fewer
            heads (query head ``n`` uses key head ``n // (h / k)``).
        src, dst: int64 key and query row of every edge, unique (see :func:`edge_set`).
        bias: added to each edge's scores, per head.
        scale: score scale; default ``1 / sqrt(e)``.
        dropout_p: dropout on the attention probabilities (the caller passes 0 in eval).
        need_weights: also return the (E, h) probabilities.

    Shape:
        - q: (n, h, e); k: (m, k, e); v: (m, k, f); src, dst: (E,); bias: (E, h)
        - returns: (n, h, f), and weights (E, h) or None

    Examples:
        >>> q, k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4)
        >>> src, dst = torch.tensor([0, 1, 2]), torch.tensor([1, 1, 2])
        >>> out, w = edge_attend(q, k, v, src, dst, need_weights=True)
        >>> out.shape, w.shape, out[0].abs().sum().item()  # query 0 has no edge: zeros
        (torch.Size([3, 2, 4]), torch.Size([3, 2]), 0.0)
    """
    explicit = need_weights or not use_fused_attn()
    if reporting():
        report("edge-explicit" if explicit else "edge", explicit_reasons(need_weights),
               q=q, k=k, v=v, num_edges=src.shape[0], dropout_p=dropout_p)
    scale = _scale(q, scale)
    if explicit:
        out, weights = edge_attend_explicit(
            q, k, v, src, dst, bias=bias, scale=scale, dropout_p=dropout_p
        )
        return out, (weights if need_weights else None)
    q = q.contiguous()
    return EdgeAttend.apply(q, k, v, bias, src, dst, scale, dropout_p), None
