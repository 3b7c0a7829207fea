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
  computes per head a sampled product on the edge pattern (SDDMM) for the scores and a
  sparse-dense product (SpMM) for the output, and keeps only the (E, h) probabilities for
  backward, which recomputes what it needs the same way: no (E, h, e) tensor is ever
  built, so peak memory is O(E·h) on top of the node tensors;
- the explicit twin :func:`edge_attend_explicit`: the formula written out with autograd (it
  keeps every gathered tensor: O(E·h·e)), which also returns the weights.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn.kernels.dense import explicit_reasons, report, reporting, use_fused_attn

__all__ = ["EdgeAttend", "edge_attend", "edge_attend_explicit", "edge_set"]

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


def _sparse_csr(crow: Tensor, col: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():  # torch warns that sparse CSR support is in beta
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


class _Pattern:
    """The edges as CSR row structure, by target (A) and, built on demand, by source (Aᵀ)."""

    def __init__(self, src: Tensor, dst: Tensor, n: int, m: int) -> None:
        self.src, self.dst, self.n, self.m = src, dst, n, m
        counts = torch.bincount(dst, minlength=n)
        self.crow = torch.zeros(n + 1, dtype=torch.long, device=dst.device)
        self.crow[1:] = counts.cumsum(0)
        self._t = None

    def by_target(self, values: Tensor) -> Tensor:
        """(n, m) CSR with ``values`` (E,) on the edges, in edge order."""
        return _sparse_csr(self.crow, self.src, values, (self.n, self.m))

    def by_source(self, values: Tensor) -> Tensor:
        """(m, n) CSR, the transpose: ``values`` (E,) in edge order are permuted to it."""
        if self._t is None:
            order = torch.sort(self.src, stable=True).indices  # targets stay sorted per row
            counts = torch.bincount(self.src, minlength=self.m)
            crow = torch.zeros(self.m + 1, dtype=torch.long, device=self.src.device)
            crow[1:] = counts.cumsum(0)
            self._t = (order, crow, self.dst.index_select(0, order))
        order, crow, col = self._t
        return _sparse_csr(crow, col, values.index_select(0, order), (self.m, self.n))

    def scores(self, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
        """(E,) ``alpha · a[dst] · b[src]`` for every edge: a sampled (SDDMM) a @ bᵀ."""
        pattern = self.by_target(a.new_zeros(self.src.shape[0]))
        out = torch.sparse.sampled_addmm(pattern, a, b.t(), beta=0.0, alpha=alpha)
        return out.values()


def _softmax_rows(scores: Tensor, dst: Tensor, n: int) -> Tensor:
    """softmax of (h, E) ``scores`` over the edges of each query; dead rows give 0."""
    with torch.no_grad():  # the softmax does not depend on the shift
        index = dst.expand_as(scores)
        peak = scores.new_full((scores.shape[0], n), -math.inf)
        peak = peak.scatter_reduce_(1, index, scores, "amax")
        peak = torch.where(torch.isneginf(peak), 0.0, peak)
    p = torch.exp(scores - peak.index_select(1, dst))
    total = p.new_zeros(scores.shape[0], n).index_add_(1, dst, p)
    total = torch.where(total > 0, total, 1.0)
    return p / total.index_select(1, dst)


def _heads(t: Tensor, acc: torch.dtype) -> Tensor:
    """(rows, h, e) -> (h, rows, e) contiguous in the accumulation dtype."""
    return t.to(acc).transpose(0, 1).contiguous()


class EdgeAttend(torch.autograd.Function):
    """Edge attention that saves only the (E, h) probabilities (and the dropout mask).

    Per head, the scores are a sampled product (SDDMM, ``torch.sparse.sampled_addmm``)
    of the queries and keys on the edge pattern, and the output a sparse-dense product
    (SpMM) of the probabilities with the values; backward is two more SDDMM / SpMM pairs.
    No (E, h, e) tensor is ever built: memory is O(E·h) on top of the node tensors. The
    scores, softmax and products run in float32 (float64 for double inputs) and the
    results are cast back to the input dtype.

    Call it through :func:`edge_attend`; ``apply(q, k, v, bias, src, dst, scale,
    dropout_p)`` with q (n, h, e), k (m, k, e), v (m, k, f), bias (E, h) or None, and the
    edges unique and sorted by (dst, src) as :func:`edge_set` returns them.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, src, dst, scale, dropout_p):  # noqa: D102
        n, heads, _ = q.shape
        m, kv_heads, _ = k.shape
        groups, acc = heads // max(kv_heads, 1), _acc(q)
        pattern = _Pattern(src, dst, n, m)
        qh, kh, vh = _heads(q, acc), _heads(k, acc), _heads(v, acc)
        scores = torch.stack([
            pattern.scores(qh[h], kh[h // groups], scale) for h in range(heads)
        ]) if src.numel() else q.new_zeros(heads, 0, dtype=acc)  # (h, E)
        if bias is not None:
            scores = scores + bias.t().to(acc)
        weights = _softmax_rows(scores, dst, n)
        keep = None
        dropped = weights
        if dropout_p > 0:
            keep = torch.rand_like(weights) >= dropout_p
            dropped = weights * keep / (1.0 - dropout_p)
        out = torch.stack([
            pattern.by_target(dropped[h]) @ vh[h // groups] for h in range(heads)
        ], dim=1) if src.numel() else q.new_zeros(n, heads, v.shape[-1], dtype=acc)
        ctx.save_for_backward(q, k, v, src, dst, weights, keep)
        ctx.scale, ctx.dropout_p, ctx.has_bias = scale, dropout_p, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, src, dst, weights, keep = ctx.saved_tensors
        n, heads, _ = q.shape
        m, kv_heads, _ = k.shape
        groups, acc = heads // max(kv_heads, 1), _acc(q)
        if src.numel() == 0:
            grad_bias = q.new_zeros(0, heads, dtype=ctx.bias_dtype) if ctx.has_bias else None
            return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), grad_bias,
                    None, None, None, None)
        pattern = _Pattern(src, dst, n, m)
        qh, kh, vh, gh = (_heads(t, acc) for t in (q, k, v, grad_out))
        dropped = weights if keep is None else weights * keep / (1.0 - ctx.dropout_p)
        d_weights = torch.stack([pattern.scores(gh[h], vh[h // groups]) for h in range(heads)])
        if keep is not None:
            d_weights = d_weights * keep / (1.0 - ctx.dropout_p)
        # softmax backward per query: ds = p * (dp - sum over its edges of p * dp)
        row = weights.new_zeros(heads, n).index_add_(1, dst, weights * d_weights)
        d_scores = weights * (d_weights - row.index_select(1, dst))
        grad_q = torch.empty_like(qh)
        grad_k, grad_v = torch.zeros_like(kh), torch.zeros_like(vh)
        for h in range(heads):
            grad_v[h // groups] += pattern.by_source(dropped[h]) @ gh[h]
            grad_q[h] = pattern.by_target(d_scores[h] * ctx.scale) @ kh[h // groups]
            grad_k[h // groups] += pattern.by_source(d_scores[h] * ctx.scale) @ qh[h]
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = d_scores.t().to(ctx.bias_dtype)
        return (grad_q.transpose(0, 1).to(q.dtype), grad_k.transpose(0, 1).to(k.dtype),
                grad_v.transpose(0, 1).to(v.dtype), grad_bias, None, None, None, None)


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
               q=q, k=k, v=v, num_edges=src.shape[0], dropout_p=dropout_p, src=src, dst=dst,
               bias=bias, scale=scale)
    scale = _scale(q, scale)
    if explicit:
        out, weights = edge_attend_explicit(
            q, k, v, src, dst, bias=bias, scale=scale, dropout_p=dropout_p
        )
        return out, (weights if need_weights else None)
    q = q.contiguous()
    return EdgeAttend.apply(q, k, v, bias, src, dst, scale, dropout_p), None
