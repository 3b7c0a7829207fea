"""The bodies of the edge kernel (:mod:`mmattn.kernels.segment`), unchecked.

Axis key: ``n`` query rows (flat tokens), ``m`` key rows, ``E`` edges, ``h`` query heads,
``k`` key/value heads (grouped-query attention, ``h = k * g``), ``g`` query heads per key
head, ``e`` head width, ``f`` value head width.

Everything here trusts its input: edges in range, and for the fused path sorted by
(target, source) (the CSR rows are built from that order with ``check_invariants=False``).
:mod:`mmattn.kernels.segment` checks and sorts before it calls these;
:class:`mmattn.EdgeAttention` calls them on the edge set it built and checked itself.

Two paths compute the same numbers:

- the default (``MMATTN_FUSED_ATTN=1``): :class:`EdgeAttend`, an ``autograd.Function``
  that computes per head a sampled product on the edge pattern (SDDMM) for the scores and
  a sparse-dense product (SpMM) for the output, and keeps only the (E, h) probabilities for
  backward, which recomputes what it needs the same way: no (E, h, e) tensor is ever built,
  so peak memory is O(E·h) on top of the node tensors;
- the explicit twin :func:`explicit_attend`: the formula written out with autograd (it keeps
  every gathered tensor: O(E·h·e)), which also returns the weights.

Both use the one segment softmax, :func:`segment_softmax`.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from mmattn.kernels._scores import acc_dtype, default_scale
from mmattn.kernels.dense import explicit_reasons, report, reporting, use_fused_attn


def unique_edges(
    src: Tensor, dst: Tensor, num_keys: int, loops: tuple[Tensor, Tensor] | None,
    bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """:func:`mmattn.kernels.segment.edge_set` without the checks."""
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


def segment_softmax(scores: Tensor, dst: Tensor, num_queries: int, dim: int = 0) -> Tensor:
    """softmax of ``scores`` over the edges of each query; dead rows give 0.

    The one segment softmax of both paths: the edges lie along ``dim`` (0 for the explicit
    twin's (E, h), 1 for the fused path's (h, E)); ``scatter_reduce`` max, ``exp``,
    ``index_add_``, in the dtype of ``scores``.

    Shape:
        - scores: (E, ...) with the edges along ``dim``; dst: (E,); returns scores' shape
    """
    shape = list(scores.shape)
    shape[dim] = num_queries
    with torch.no_grad():  # the softmax does not depend on the shift: no gradient through it
        view = [1] * scores.dim()
        view[dim] = -1
        index = dst.view(view).expand_as(scores)
        peak = scores.new_full(shape, -math.inf).scatter_reduce_(dim, index, scores, "amax")
        peak = torch.where(torch.isneginf(peak), 0.0, peak)
    p = torch.exp(scores - peak.index_select(dim, dst))
    total = p.new_zeros(shape).index_add_(dim, dst, p)
    total = torch.where(total > 0, total, 1.0)  # a query whose every score is -inf: zeros
    return p / total.index_select(dim, dst)


def explicit_attend(
    q: Tensor, k: Tensor, v: Tensor, src: Tensor, dst: Tensor, *, bias: Tensor | None,
    scale: float | None, dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """The readable twin: gather, score, segment softmax, weighted ``index_add_``."""
    groups = q.shape[1] // max(k.shape[1], 1)
    scale = default_scale(q, scale)
    acc = acc_dtype(q)
    k = k.repeat_interleave(groups, dim=1)  # (m, h, e): query head n uses key head n // g
    v = v.repeat_interleave(groups, dim=1)
    scores = (q[dst].to(acc) * k[src].to(acc)).sum(-1) * scale  # (E, h)
    if bias is not None:
        scores = scores + bias.to(acc)
    weights = segment_softmax(scores, dst, q.shape[0])
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=acc)
    out = out.index_add(0, dst, dropped[..., None] * v[src].to(acc))
    return out.to(q.dtype), weights


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

    ``apply(q, k, v, bias, src, dst, scale, dropout_p)`` with q (n, h, e), k (m, k, e),
    v (m, k, f), bias (E, h) or None, and int64 edges in range and sorted by (dst, src).
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, src, dst, scale, dropout_p):  # noqa: D102
        n, heads, _ = q.shape
        m, kv_heads, _ = k.shape
        groups, acc = heads // max(kv_heads, 1), acc_dtype(q)
        pattern = _Pattern(src, dst, n, m)
        qh, kh, vh = _heads(q, acc), _heads(k, acc), _heads(v, acc)
        scores = torch.stack([
            pattern.scores(qh[h], kh[h // groups], scale) for h in range(heads)
        ]) if src.numel() else q.new_zeros(heads, 0, dtype=acc)  # (h, E)
        if bias is not None:
            scores = scores + bias.t().to(acc)
        weights = segment_softmax(scores, dst, n, dim=1)
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
        groups, acc = heads // max(kv_heads, 1), acc_dtype(q)
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


@torch.compiler.disable  # sparse CSR products and an autograd.Function: run eagerly
def attend_sorted(
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
    """:func:`mmattn.kernels.segment.edge_attend` without checks, on int64 edges in range
    and sorted by (dst, src) (what :func:`unique_edges` returns)."""
    explicit = need_weights or not use_fused_attn()
    if reporting():
        report("edge-explicit" if explicit else "edge", explicit_reasons(need_weights),
               q=q, k=k, v=v, num_edges=src.shape[0], dropout_p=dropout_p, src=src, dst=dst,
               bias=bias, scale=scale)
    scale = default_scale(q, scale)
    if explicit:
        out, weights = explicit_attend(
            q, k, v, src, dst, bias=bias, scale=scale, dropout_p=dropout_p
        )
        return out, (weights if need_weights else None)
    q = q.contiguous()
    return EdgeAttend.apply(q, k, v, bias, src, dst, scale, dropout_p), None
