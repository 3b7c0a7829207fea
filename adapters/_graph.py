"""Graph helpers behind :mod:`adapters.graph`: edge checks, Laplacian eigenvectors, and the
edges in token coordinates.

Axis key: ``n`` nodes of the whole batch (N_total), ``b`` graphs, ``i``/``j`` node slots
(N_max), ``k`` Laplacian eigenvectors.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from adapters._imports import require
from mmattn._checks import (
    check_integer_dtype,
    check_positive_int,
    check_range,
    check_rank,
    check_same_device,
)

_PAD_EIGENVALUE = 10.0  # above the normalized Laplacian's spectrum [0, 2]


def _check_edge_index(
    edge_index: object, batch: Tensor | None = None, num_nodes: int | None = None
) -> Tensor:
    """Shape, dtype, device and range of ``edge_index``; no edge may join two graphs.

    ``num_nodes`` defaults to ``len(batch)``; without either, only negative ids are refused.
    """
    check_integer_dtype("edge_index", edge_index, "node ids")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(
            f"edge_index must have shape (2, num_edges), got {tuple(edge_index.shape)}"
        )
    if batch is not None:
        check_rank("batch", batch, (1,), "(num_nodes,)")
        check_integer_dtype("batch", batch, "graph id of every node")
        check_same_device("edge_index", edge_index, "batch", batch)
        num_nodes = batch.shape[0] if num_nodes is None else num_nodes
    if num_nodes is None:
        check_range("edge_index", edge_index, 0, torch.iinfo(torch.int64).max)
    else:
        check_range("edge_index", edge_index, 0, num_nodes, "num_nodes")
    if batch is not None and edge_index.numel() and not torch.compiler.is_compiling():
        graphs = batch.long()[edge_index.long()]  # (2, e): graph of source and target
        crossing = graphs[0] != graphs[1]
        if bool(crossing.any()):
            first = int(crossing.nonzero()[0, 0])
            raise ValueError(
                "edge_index must join nodes of the same graph, got edge "
                f"{edge_index[:, first].tolist()} between graphs {graphs[:, first].tolist()}"
            )
    return edge_index


def laplacian_eigenvectors(
    edge_index: Tensor,
    batch: Tensor | None,
    k: int,
    *,
    max_num_nodes: int | None = None,
    batch_size: int | None = None,
) -> Tensor:
    r"""The ``k`` eigenvectors after the first of each graph's normalized Laplacian.

    :math:`L = I - D^{-1/2} A D^{-1/2}` of the symmetrized graph, one dense ``eigh`` for the
    whole batch in float32 (padded slots get eigenvalue 10, outside the graphs' spectrum
    [0, 2], so they never mix into a graph's eigenvectors). The sign of each eigenvector is
    fixed so that its largest-magnitude entry is positive. Graphs with ``N <= k`` nodes get
    zeros for the missing eigenvectors.

    Shape:
        - Output: (B, N_max, k), zero on padded slots; (B, 0, k) when there are no nodes

    Raises:
        TypeError / ValueError: as :func:`neighbourhood_mask`; ``k`` not a positive int.

    Examples:
        >>> edge_index = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
        >>> laplacian_eigenvectors(edge_index, None, 2).shape
        torch.Size([1, 3, 2])
    """
    utils = require("torch_geometric.utils", "laplacian_eigenvectors")
    _check_edge_index(edge_index, batch, None if batch is not None else max_num_nodes)
    check_positive_int("k", k)
    adj = utils.to_dense_adj(edge_index, batch, max_num_nodes=max_num_nodes, batch_size=batch_size)
    if adj.shape[-1] == 0:  # no nodes at all: nothing to decompose
        return adj.new_zeros(adj.shape[0], 0, k)
    adj = ((adj + rearrange(adj, "b i j -> b j i")) > 0).float()
    adj = adj * ~torch.eye(adj.shape[-1], dtype=torch.bool, device=adj.device)
    if batch is None:
        batch = torch.zeros(adj.shape[-1], dtype=torch.long, device=adj.device)
    counts = torch.bincount(batch, minlength=adj.shape[0])
    real = torch.arange(adj.shape[-1], device=adj.device) < counts[:, None]  # (b, i)
    deg = adj.sum(-1)
    dinv = torch.where(deg > 0, deg.clamp_min(1e-12).rsqrt(), torch.zeros_like(deg))
    lap = -rearrange(dinv, "b i -> b i 1") * adj * rearrange(dinv, "b j -> b 1 j")
    diag = torch.where(real, 1.0, _PAD_EIGENVALUE)
    lap = lap + torch.diag_embed(diag)
    _, vectors = torch.linalg.eigh(lap)  # ascending eigenvalues; columns are eigenvectors
    vectors = vectors[..., 1 : k + 1]
    peak = vectors.abs().argmax(dim=1, keepdim=True)
    sign = torch.sign(vectors.gather(1, peak))
    vectors = vectors * torch.where(sign == 0, 1.0, sign)
    vectors = vectors * rearrange(real, "b i -> b i 1")  # padded-slot vectors are zero on real
    if vectors.shape[-1] < k:  # fewer slots than k: pad with zero columns
        vectors = torch.nn.functional.pad(vectors, (0, k - vectors.shape[-1]))
    return vectors


def token_edges(edge_index: Tensor, batch: Tensor, length: int) -> Tensor:
    """PyG's node ids to the flat padded token order: node n of graph g -> ``g·L + slot``.

    ``slot = n - ptr[g]`` is where ``to_dense_batch`` puts the node, so ``edge_index`` of
    the result indexes the rows of ``tokens.x.reshape(B * L, D)``.

    Shape:
        - edge_index: (2, E); batch: (N_total,) sorted; returns (2, E) int64
    """
    counts = torch.bincount(batch)
    ptr = torch.cumsum(counts, 0) - counts
    nodes = torch.arange(batch.shape[0], device=batch.device)
    flat = batch * length + nodes - ptr[batch]
    return flat[edge_index.long()]
