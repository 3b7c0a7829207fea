"""Attention sinks and soft-capping on the edge kernel (:mod:`mmattn.kernels.segment`).

Axis key: ``n`` query rows, ``m`` key rows, ``E`` edges, ``h`` query heads, ``k`` key/value
heads, ``e`` head width, ``f`` value head width.

For an edge (j → i) with score ``s = q_i · k_j · scale``::

    softcap   s ← c · tanh(s / c)                     before the edge bias
    sinks     w_ji = exp(s_ji) / (Σ_{j'} exp(s_j'i) + exp(σ_h))

How each runs:

- sinks, fused: the sink is one more edge into every query, from a zero key and value row
  appended at index ``m``, whose bias is ``σ_h`` (its score ``q · 0 = 0``). The memory-lean
  :class:`~mmattn.kernels._segment.EdgeAttend` then runs unchanged on ``E + n`` edges and
  its bias gradient is the sinks' gradient. A query with no edge keeps only its sink: its
  result is 0, as without sinks.
- softcap is not linear in the score: the explicit twin (:func:`edge_attend_modified_explicit`,
  O(E·h·e)) runs, as every kernel's softcap does.

ALiBi has no edge form: graph nodes have no order, so :class:`mmattn.EdgeAttention`
refuses ``alibi=True``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn.kernels._scores import acc_dtype, default_scale
from mmattn.kernels._segment import EdgeAttend, segment_softmax
from mmattn.kernels._tiles import Weights, modifiers_of
from mmattn.kernels.dense import explicit_reasons, report, reporting, use_fused_attn
from mmattn.kernels.modifiers import Modifiers

__all__ = ["edge_attend_modified", "edge_attend_modified_explicit", "sink_edges"]


def sink_edges(
    src: Tensor, dst: Tensor, bias: Tensor | None, sinks: Tensor, num_queries: int,
    num_keys: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The edges with one sink edge ``(num_keys → i)`` after the edges of every query i, still
    sorted by (dst, src), and the bias with ``σ_h`` on the sink edges (0 where none was).

    Shape:
        - src, dst: (E,) sorted by (dst, src); bias: (E, h) or None; sinks: (h,)
        - returns: src, dst (E + n,), bias (E + n, h)
    """
    n, edges = num_queries, src.shape[0]
    queries = torch.arange(n, device=dst.device)
    ends = torch.bincount(dst, minlength=n).cumsum(0)  # edges into queries 0 .. i
    order = torch.empty(edges + n, dtype=torch.long, device=dst.device)
    order[torch.arange(edges, device=dst.device) + dst] = torch.arange(edges, device=dst.device)
    order[ends + queries] = edges + queries
    real = bias if bias is not None else sinks.new_zeros(edges, sinks.shape[0])
    rows = torch.cat([real, sinks.to(real.dtype)[None].expand(n, -1)]).index_select(0, order)
    new_src = torch.cat([src, src.new_full((n,), num_keys)]).index_select(0, order)
    new_dst = torch.cat([dst, queries]).index_select(0, order)
    return new_src, new_dst, rows


def edge_attend_modified_explicit(
    q: Tensor, k: Tensor, v: Tensor, src: Tensor, dst: Tensor, modifiers: Modifiers, *,
    bias: Tensor | None = None, scale: float, dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The explicit twin with softcap and sinks: gather, score, cap, bias, segment softmax
    with the sink, weighted ``index_add``. The weights leave the sink out.

    Shape:
        - q: (n, h, e); k: (m, k, e); v: (m, k, f); src, dst: (E,); bias: (E, h)
        - returns: (n, h, f) and the weights (E, h) (before dropout)
    """
    n, edges = q.shape[0], src.shape[0]
    groups, acc = q.shape[1] // max(k.shape[1], 1), acc_dtype(q)
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q[dst].to(acc) * k[src].to(acc)).sum(-1) * scale  # (E, h)
    if modifiers.softcap is not None:
        scores = torch.tanh(scores / modifiers.softcap) * modifiers.softcap
    if bias is not None:
        scores = scores + bias.to(acc)
    if modifiers.sinks is None:
        weights = segment_softmax(scores, dst, n)
    else:  # the sink: one more score sigma_h per query, in the one segment softmax
        sinks = modifiers.sinks.to(acc)[None].expand(n, -1)  # (n, h)
        queries = torch.arange(n, device=dst.device)
        weights = segment_softmax(torch.cat([scores, sinks]), torch.cat([dst, queries]), n)
        weights = weights[:edges]
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = q.new_zeros(n, q.shape[1], v.shape[-1], dtype=acc)
    out = out.index_add(0, dst, dropped[..., None] * v[src].to(acc))
    return out.to(q.dtype), weights


@torch.compiler.disable  # sparse CSR products and an autograd.Function: run eagerly
def edge_attend_modified(
    q: Tensor, k: Tensor, v: Tensor, src: Tensor, dst: Tensor, modifiers: Modifiers, *,
    bias: Tensor | None = None, scale: float | None = None, dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """:func:`~mmattn.kernels.segment.edge_attend` with sinks and softcap (see the module
    docstring): sinks alone run fused, softcap (or weights, or ``MMATTN_FUSED_ATTN=0``) the
    explicit twin.

    Shape:
        - q: (n, h, e); k: (m, k, e); v: (m, k, f); src, dst: (E,) unique, sorted by
          (dst, src); bias: (E, h); modifiers: sinks (h,) and / or softcap
        - returns: (n, h, f), and weights (E, h) or None
    """
    explicit = need_weights or not use_fused_attn() or modifiers.explicit
    if reporting():
        report("edge-explicit" if explicit else "edge", explicit_reasons(need_weights, modifiers),
               q=q, k=k, v=v, num_edges=src.shape[0], dropout_p=dropout_p, src=src, dst=dst,
               bias=bias, scale=scale, modifiers=modifiers)
    scale = default_scale(q, scale)
    if explicit:
        out, weights = edge_attend_modified_explicit(
            q, k, v, src, dst, modifiers, bias=bias, scale=scale, dropout_p=dropout_p
        )
        return out, (weights if need_weights else None)
    if modifiers.sinks is not None:
        src, dst, bias = sink_edges(src, dst, bias, modifiers.sinks, q.shape[0], k.shape[0])
        k = torch.cat([k, k.new_zeros(1, *k.shape[1:])])
        v = torch.cat([v, v.new_zeros(1, *v.shape[1:])])
    return EdgeAttend.apply(q.contiguous(), k, v, bias, src, dst, scale, dropout_p), None


def edge_weights(record: dict) -> Weights:
    """The (E, h) weights of an edge call's report with the query (``dst``) and key
    (``src``) row of each edge (:func:`mmattn.kernels._report_tiles.weight_tiles`), from the
    explicit twin (scores, softcap, sink, segment softmax) on zero-width values."""
    q, k, dst, src = record["q"], record["k"], record["dst"], record["src"]
    none = k.new_zeros(*k.shape[:-1], 0)
    w = edge_attend_modified_explicit(
        q, k, none, src, dst, modifiers_of(record) or Modifiers(), bias=record.get("bias"),
        scale=default_scale(q, record.get("scale")))[1]
    return Weights(dst, src, w)
