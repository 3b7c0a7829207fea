"""Attention along the edges of a graph: segment softmax over edge lists, in O(E).

Axis key: ``n`` query rows (flat tokens), ``m`` key rows, ``E`` edges, ``h`` query heads,
``k`` key/value heads (grouped-query attention, ``h = k * g``), ``g`` query heads per key
head, ``e`` head width, ``f`` value head width.

An edge ``(src, dst)`` lets query row ``dst`` attend key row ``src``. For every edge the
score is :math:`s = q_{dst} \\cdot k_{src} / \\sqrt{e}` (+ an edge bias); the softmax runs
over the edges of each query (a segment softmax: ``scatter_reduce`` max, ``exp``,
``index_add_``), and the result is the weighted sum of the values of those edges. A query
with no edge gets zeros, never NaN.

The public entry points are :func:`edge_attend`, :func:`edge_attend_explicit` and
:func:`edge_set`. They check their input (shapes, dtypes, devices in O(1); edge ids in
range, read once in O(E)) and :func:`edge_attend` sorts edges that are not sorted by
(target, source), which its fused path needs; an id out of range is always refused, so no
kernel reads outside its tensors. The layer (:class:`mmattn.EdgeAttention`) checks its own
input, builds the edge set and calls the unchecked bodies (:mod:`._segment`).

The default path (``MMATTN_FUSED_ATTN=1``) is a memory-lean ``autograd.Function``: per head a
sampled product on the edge pattern (SDDMM) for the scores and a sparse-dense product (SpMM)
for the output, keeping only the (E, h) probabilities for backward (O(E·h) memory); the
explicit twin :func:`edge_attend_explicit` writes the formula out with autograd (O(E·h·e)).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmattn import _checks as checks
from mmattn.kernels import _inputs
from mmattn.kernels._segment import attend_sorted, explicit_attend, unique_edges
from mmattn.kernels.dense import use_fused_attn

__all__ = ["edge_attend", "edge_attend_explicit", "edge_set"]


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

    Raises:
        TypeError / ValueError: ids that are not 1-D integer tensors of one length, or lie
            outside [0, num_keys) (sources); loops or a bias that do not fit.

    Examples:
        >>> src, dst, _, dup = edge_set(torch.tensor([1, 0, 1]), torch.tensor([1, 1, 1]), 2)
        >>> src.tolist(), dst.tolist(), dup
        ([0, 1], [1, 1], True)
    """
    num_keys = checks.check_positive_int("num_keys", num_keys, minimum=0)
    _check_ids(src, dst, num_keys, None, None)
    if loops is not None:
        if not isinstance(loops, (tuple, list)) or len(loops) != 2:
            raise TypeError(f"loops must be a (src, dst) pair of tensors, got {loops!r}")
        _check_ids(loops[0], loops[1], num_keys, None, None, names=("loops[0]", "loops[1]"))
    if bias is not None:
        _check_bias(bias, src.shape[0], None, src)
    if loops is not None:
        loops = (loops[0].long(), loops[1].long())
    return unique_edges(src.long(), dst.long(), num_keys, loops, bias)


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

    Takes the arguments of :func:`edge_attend` (edges in any order) and checks them the same
    way; it keeps every gathered tensor for autograd (O(E·h·e) memory).

    Shape:
        - q: (n, h, e); k: (m, k, e); v: (m, k, f); src, dst: (E,); bias: (E, h)
        - returns: (n, h, f) and the weights (E, h) (before dropout)

    Raises:
        TypeError / ValueError: as :func:`edge_attend`.

    Examples:
        >>> q = k = v = torch.randn(3, 2, 4)
        >>> out, w = edge_attend_explicit(q, k, v, torch.tensor([2, 0]), torch.tensor([0, 0]))
        >>> out.shape, w.shape  # query 0 attends rows 2 and 0; queries 1, 2 get zeros
        (torch.Size([3, 2, 4]), torch.Size([2, 2]))
    """
    _check(q, k, v, src, dst, bias, scale, dropout_p, False)
    src, dst = src.long(), dst.long()
    return explicit_attend(q, k, v, src, dst, bias=bias, scale=scale, dropout_p=dropout_p)


@torch.compiler.disable  # data-dependent (ids read, sparse CSR products): runs eagerly
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
    """Attention along edges: the memory-lean fused path, or the explicit twin.

    The explicit twin runs when weights are requested or ``MMATTN_FUSED_ATTN=0``. Edges may
    come in any order and repeat (a repeated edge counts twice, on both paths); the fused
    path sorts them by (target, source) when they are not (an O(E) check first).

    Args:
        q, k, v: query rows and key/value rows, head-split; ``k``/``v`` may have fewer
            heads (query head ``n`` uses key head ``n // (h / k)``).
        src, dst: integer key and query row of every edge, in [0, m) and [0, n).
        bias: added to each edge's scores, per head.
        scale: score scale; default ``1 / sqrt(e)``.
        dropout_p: dropout on the attention probabilities (the caller passes 0 in eval).
        need_weights: also return the (E, h) probabilities, in the order of the edges given.

    Shape:
        - q: (n, h, e); k: (m, k, e); v: (m, k, f); src, dst: (E,); bias: (E, h)
        - returns: (n, h, f), and weights (E, h) or None

    Raises:
        TypeError: q, k, v not floating tensors of one dtype; ids not integer tensors; a
            bias that is not floating.
        ValueError: shapes that do not fit (rows, heads, widths; ids of different lengths
            or not 1-D; a bias not (E, h)); ids outside [0, m) or [0, n); another device;
            ``dropout_p`` outside [0, 1).

    Examples:
        >>> q, k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4)
        >>> src, dst = torch.tensor([0, 1, 2]), torch.tensor([1, 1, 2])
        >>> out, w = edge_attend(q, k, v, src, dst, need_weights=True)
        >>> out.shape, w.shape, out[0].abs().sum().item()  # query 0 has no edge: zeros
        (torch.Size([3, 2, 4]), torch.Size([3, 2]), 0.0)
    """
    _check(q, k, v, src, dst, bias, scale, dropout_p, need_weights)
    src, dst = src.long(), dst.long()
    if not (need_weights or not use_fused_attn()) and src.shape[0] > 1:
        order = dst * k.shape[0] + src
        if not bool((order[1:] >= order[:-1]).all()):  # the CSR rows need this order
            order = torch.sort(order, stable=True).indices
            src, dst = src[order], dst[order]
            bias = None if bias is None else bias[order]
    return attend_sorted(
        q, k, v, src, dst, bias=bias, scale=scale, dropout_p=dropout_p,
        need_weights=need_weights,
    )


def _check(
    q: object, k: object, v: object, src: object, dst: object, bias: object, scale: object,
    dropout_p: object, need_weights: object,
) -> None:
    """The checks of the public entry points (see :func:`edge_attend`)."""
    _inputs.check_heads(q, k, v, "(n, h, e)")
    _check_ids(src, dst, k.shape[0], q.shape[0], q)
    if bias is not None:
        _check_bias(bias, src.shape[0], q.shape[1], q)
    _inputs.check_options(dropout_p, scale, need_weights)


def _check_ids(
    src: object, dst: object, num_keys: int, num_queries: int | None, like: Tensor | None,
    names: tuple[str, str] = ("src", "dst"),
) -> None:
    """1-D integer ids of one length, sources in [0, num_keys), targets in [0, num_queries)
    (when given), on ``like``'s device (when given); read once (O(E))."""
    for name, ids in zip(names, (src, dst)):
        checks.check_integer_dtype(name, ids, "row ids")
        checks.check_rank(name, ids, (1,), "(num_edges,)")
        if like is not None:
            checks.check_same_device(name, ids, "q", like)
    if src.shape != dst.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must hold one id per edge, got {src.shape[0]} and "
            f"{dst.shape[0]} ids"
        )
    if src.device != dst.device:
        checks.check_same_device(names[1], dst, names[0], src)
    checks.check_range(f"{names[0]} (key rows)", src, 0, num_keys, "number of key rows")
    if num_queries is not None:
        checks.check_range(f"{names[1]} (query rows)", dst, 0, num_queries,
                           "number of query rows")


def _check_bias(bias: object, num_edges: int, heads: int | None, like: Tensor) -> None:
    checks.check_tensor("bias", bias)
    checks.check_floating("bias", bias)
    width = bias.shape[-1] if heads is None and bias.dim() == 2 else heads
    checks.check_shape("bias", bias, (num_edges, width), "(num_edges, heads)")
    checks.check_same_device("bias", bias, "src", like)
