"""Graphs: ``GraphNodeSequencer`` (a torch_geometric batch -> padded node tokens) and the
neighbourhood attention mask.

Axis key: ``n`` nodes of the whole batch (N_total), ``f`` node feature width
(``in_channels``), ``b`` graphs, ``i``/``j`` query/key node slots (N_max, the largest graph),
``d`` model width (``embed_dim``), ``h`` heads, ``k`` Laplacian eigenvectors.

    Data / Batch: x (n, f), edge_index (2, E), batch (n,)
      ──linear (+ degree / Laplacian encodings)──▶ (n, d)
      ──to_dense_batch──▶ Tokens(x (b, i, d), mask (b, i))  ──to_nodes──▶ (n, d)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from einops import rearrange, repeat
from torch import Tensor, nn

from adapters._graph import _check_edge_index, laplacian_eigenvectors, token_edges
from adapters._imports import require
from adapters.base import ModalityAdapter
from mmattn._checks import (
    check_factory_dtype,
    check_has_data,
    check_positive_int,
    check_rank,
    check_same_device,
)
from mmattn.masks import k_hop_edges
from mmattn.tokens import Tokens, check_tokens

if TYPE_CHECKING:  # pragma: no cover
    from torch_geometric.data import Data

__all__ = ["GraphNodeSequencer", "laplacian_eigenvectors", "neighbourhood_mask"]

STRUCTURAL = ("degree", "laplacian")


def _pyg(what: str):
    return require("torch_geometric", what)


def neighbourhood_mask(
    edge_index: Tensor,
    batch: Tensor | None = None,
    num_hops: int = 1,
    *,
    num_heads: int | None = None,
    max_num_nodes: int | None = None,
    batch_size: int | None = None,
) -> Tensor:
    r"""k-hop neighbourhood attention mask, **True = not allowed** (the module direction).

    Query node ``i`` may attend key node ``j`` of the same graph iff there is a path of at
    most ``num_hops`` edges from ``j`` to ``i`` (messages flow ``source -> target`` as in
    torch_geometric; give both directions for an undirected graph). Every node may attend
    itself, so no row is fully masked; padded slots may attend only themselves and no real
    node may attend a padded slot.

    Args:
        edge_index: edges ``(source, target)`` with global node ids.
        batch: graph id of every node (sorted); None means one graph whose size is
            ``max_num_nodes`` or, without it, ``edge_index.max() + 1``.
        num_hops: ``k``, the path length allowed.
        num_heads: when given, repeat the mask per head to (B * num_heads, N_max, N_max),
            batch-major, the layout ``attn_mask`` of the attention modules and of
            ``torch.nn.MultiheadAttention`` takes.
        max_num_nodes: ``N_max`` (default: the largest graph).
        batch_size: number of graphs (default: ``batch.max() + 1``).

    Shape:
        - edge_index: (2, E)
        - batch: (N_total,)
        - Output: (B, N_max, N_max) bool, or (B * num_heads, N_max, N_max)

    Raises:
        TypeError / ValueError: bad ``edge_index`` shape or dtype; node ids below 0, past
            the nodes of ``batch`` (or ``max_num_nodes`` for one graph), or an edge joining
            two graphs; ``edge_index`` and ``batch`` on different devices; non-positive
            ``num_hops``.
        ImportError: torch_geometric is missing.

    Examples:
        >>> edge_index = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])  # a path 0 - 1 - 2
        >>> (~neighbourhood_mask(edge_index, num_hops=1))[0].int().tolist()
        [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
    """
    utils = require("torch_geometric.utils", "neighbourhood_mask")
    _check_edge_index(edge_index, batch, None if batch is not None else max_num_nodes)
    check_positive_int("num_hops", num_hops)
    adj = utils.to_dense_adj(edge_index, batch, max_num_nodes=max_num_nodes, batch_size=batch_size)
    step = rearrange(adj, "b j i -> b i j") > 0  # adj[b, source, target]; query = target
    step = step | torch.eye(step.shape[-1], dtype=torch.bool, device=step.device)
    reach, step_f = step, step.float()
    for _ in range(num_hops - 1):
        reach = (reach.float() @ step_f) > 0
    blocked = ~reach
    if num_heads is not None:
        check_positive_int("num_heads", num_heads)
        blocked = repeat(blocked, "b i j -> (b h) i j", h=num_heads)
    return blocked


class GraphNodeSequencer(ModalityAdapter):
    r"""A torch_geometric ``Data``/``Batch`` to padded node tokens with a mask.

    Node features are projected, optional structural encodings are added, and the nodes are
    laid out per graph with ``torch_geometric.utils.to_dense_batch``:

    .. math:: h_n = W x_n + b \;[+\, E_{\deg}[\min(\deg_n, \mathrm{max\_degree})]]
        \;[+\, W_{\mathrm{lap}} \phi_n]

    Node ``n`` of graph ``g`` lands at ``x[g, n - ptr[g]]``; :meth:`to_nodes` is the exact
    inverse (same node order). For attention that follows the graph, pass
    :meth:`neighbourhood_mask` as ``attn_mask`` (dense, O(N_max²)), or use
    :class:`mmattn.EdgeAttention` (``attention="edge"`` in a block), which reads the edges
    from ``meta["edge_index"]`` in O(E).

    Args:
        in_channels: node feature width ``F`` (``data.x.shape[1]``).
        embed_dim: token width ``D``.
        structural: any of "degree" (in-degree embedding) and "laplacian" (normalized
            Laplacian eigenvectors, see :func:`laplacian_eigenvectors`).
        max_degree: in-degrees above it share the last degree embedding.
        num_eigenvectors: ``k`` for "laplacian".
        num_hops: ``meta["edge_index"]`` holds the pairs joined by a path of at most this
            many edges (:func:`mmattn.masks.k_hop_edges`); 1 = the graph's own edges.
        bias: bias of the projection.
        device: parameter device.
        dtype: parameter dtype; the tokens come out in it.

    Shape:
        - data.x: (N_total, F); data.edge_index: (2, E); data.batch: (N_total,) sorted
        - Output: ``Tokens`` x (B, N_max, D), mask (B, N_max), meta ``batch``, ``num_nodes``,
          ``num_graphs`` and ``edge_index`` (2, E) in token coordinates: ``g·N_max + slot``
          padded, PyG's own node ids (the rows of ``values()``) packed

    Raises:
        TypeError: ``data`` is not a torch_geometric ``Data``; ``x`` is not floating.
        ValueError: ``data.x`` missing, not 2-D or of the wrong width; unsorted ``batch``.
        ImportError: torch_geometric is missing (``pip install "mmattn[graph]"``).

    Examples:
        >>> from torch_geometric.data import Batch, Data
        >>> graphs = [Data(x=torch.randn(n, 4), edge_index=torch.empty(2, 0, dtype=torch.long))
        ...           for n in (3, 5)]
        >>> seq = GraphNodeSequencer(4, 16)
        >>> out = seq(Batch.from_data_list(graphs))
        >>> out.x.shape, out.lengths.tolist(), seq.to_nodes(out).shape
        (torch.Size([2, 5, 16]), [3, 5], torch.Size([8, 16]))
    """

    modality = "graph"

    @classmethod
    def example(cls) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """A batch of three small random graphs (see :meth:`ModalityAdapter.example`).

        Raises:
            ImportError: torch_geometric is missing (the message names the pip extra).
        """
        data = require("torch_geometric.data", "graph")
        graphs = [
            data.Data(x=torch.randn(n, 5), edge_index=torch.randint(0, n, (2, 2 * n)))
            for n in (4, 2, 6)
        ]
        kwargs = dict(
            in_channels=5, embed_dim=16, structural=("degree", "laplacian"), num_eigenvectors=3
        )
        return kwargs, (data.Batch.from_data_list(graphs),)

    def __init__(
        self,
        in_channels: int,
        embed_dim: int,
        *,
        structural: Sequence[str] = (),
        max_degree: int = 32,
        num_eigenvectors: int = 8,
        num_hops: int = 1,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(embed_dim)
        dtype = check_factory_dtype("dtype", dtype)
        _pyg("GraphNodeSequencer")
        self.in_channels = check_positive_int("in_channels", in_channels)
        if isinstance(structural, str):
            structural = (structural,)
        unknown = [s for s in structural if s not in STRUCTURAL]
        if unknown:
            raise ValueError(f"structural must hold names from {STRUCTURAL}, got {unknown}")
        self.structural = tuple(structural)
        self.max_degree = check_positive_int("max_degree", max_degree, minimum=0)
        self.num_eigenvectors = check_positive_int("num_eigenvectors", num_eigenvectors)
        self.num_hops = check_positive_int("num_hops", num_hops)
        self.proj = nn.Linear(in_channels, embed_dim, bias=bias, device=device, dtype=dtype)
        self.degree_embedding = (
            nn.Embedding(max_degree + 1, embed_dim, device=device, dtype=dtype)
            if "degree" in self.structural
            else None
        )
        self.laplacian_proj = (
            nn.Linear(num_eigenvectors, embed_dim, bias=False, device=device, dtype=dtype)
            if "laplacian" in self.structural
            else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()
        if self.degree_embedding is not None:
            nn.init.normal_(self.degree_embedding.weight, std=0.02)
        if self.laplacian_proj is not None:
            self.laplacian_proj.reset_parameters()

    def _unpack(self, data: Data) -> tuple[Tensor, Tensor, Tensor, int | None]:
        """x, edge_index, batch (zeros for a single graph) and the number of graphs."""
        pyg = _pyg("GraphNodeSequencer")
        if not isinstance(data, pyg.data.Data):
            raise TypeError(
                f"data must be a torch_geometric Data or Batch, got {type(data).__name__}"
            )
        x = getattr(data, "x", None)
        if x is None:
            raise ValueError("data.x must hold the node features (N, in_channels), got None")
        check_rank("data.x", x, (2,), "(num_nodes, in_channels)")
        if not x.is_floating_point():
            raise TypeError(f"data.x must have a floating-point dtype, got {x.dtype}")
        if x.shape[1] != self.in_channels:
            raise ValueError(
                f"data.x must have in_channels={self.in_channels} columns, got shape "
                f"{tuple(x.shape)}"
            )
        check_has_data("data.x", x)
        edge_index = getattr(data, "edge_index", None)
        if edge_index is None:
            edge_index = torch.empty(2, 0, dtype=torch.long, device=x.device)
        check_same_device("data.edge_index", edge_index, "data.x", x)
        batch = getattr(data, "batch", None)
        if batch is None:
            batch, num_graphs = torch.zeros(x.shape[0], dtype=torch.long, device=x.device), 1
        else:
            check_rank("data.batch", batch, (1,), "(num_nodes,)")
            check_same_device("data.batch", batch, "data.x", x)
            if batch.shape[0] != x.shape[0]:
                raise ValueError(
                    f"data.batch must have num_nodes={x.shape[0]} entries, got {batch.shape[0]}"
                )
            if not isinstance(data, pyg.data.Batch) and bool((batch[1:] < batch[:-1]).any()):
                raise ValueError("data.batch must be sorted (as Batch.from_data_list makes it)")
            num_graphs = getattr(data, "num_graphs", None)
        try:
            _check_edge_index(edge_index, batch)
        except (TypeError, ValueError) as err:  # name the attribute the user set
            raise type(err)(f"data.{err}") from None
        return x, edge_index, batch, num_graphs

    def _structural(
        self, x: Tensor, edge_index: Tensor, batch: Tensor, num_graphs: int | None
    ) -> Tensor | None:
        extra = None
        if self.degree_embedding is not None:
            utils = _pyg("GraphNodeSequencer")
            deg = utils.utils.degree(edge_index[1], x.shape[0], dtype=torch.long)
            extra = self.degree_embedding(deg.clamp_max(self.max_degree))
        if self.laplacian_proj is not None:
            vectors = laplacian_eigenvectors(
                edge_index, batch, self.num_eigenvectors, batch_size=num_graphs
            )
            counts = torch.bincount(batch, minlength=vectors.shape[0])
            ptr = torch.cumsum(counts, 0) - counts
            slot = torch.arange(x.shape[0], device=x.device) - ptr[batch]
            lap = self.laplacian_proj(vectors[batch, slot].to(self.laplacian_proj.weight.dtype))
            extra = lap if extra is None else extra + lap
        return extra

    def forward(self, data: Data, *, packed: bool = False) -> Tokens:
        """Node tokens of ``data``: padded with a mask, or packed (``packed=True``).

        Packed, the projected nodes stay in PyG's own layout: ``x`` is a jagged (B, n*, D)
        view of the (N_total, D) node rows with ``data.ptr`` (or the ``batch`` counts) as
        offsets; nothing is padded and no ``to_dense_batch`` runs.
        """
        pyg = _pyg("GraphNodeSequencer")
        x, edge_index, batch, num_graphs = self._unpack(data)
        dtype, device = self._param_dtype_device()
        # moved to the module's device, as every adapter's input
        x, edge_index, batch = (t.to(device) for t in (x, edge_index, batch))
        h = self.proj(x.to(dtype))
        if self.structural:
            h = h + self._structural(x, edge_index, batch, num_graphs)
        if self.num_hops > 1:
            edge_index = k_hop_edges(edge_index, self.num_hops, x.shape[0])
        if packed:
            offsets = _node_offsets(data, batch, num_graphs).to(h.device)
            meta = {"modality": self.modality, "batch": batch, "num_nodes": x.shape[0],
                    "num_graphs": offsets.shape[0] - 1, "edge_index": edge_index}
            return Tokens.from_packed(h, offsets, meta)
        dense, mask = pyg.utils.to_dense_batch(h, batch, batch_size=num_graphs)
        meta = {
            "modality": self.modality,
            "batch": batch,
            "num_nodes": x.shape[0],
            "num_graphs": dense.shape[0],
            "edge_index": token_edges(edge_index, batch, dense.shape[1]),
        }
        return Tokens(dense, mask, meta)

    def to_nodes(self, tokens: Tokens) -> Tensor:
        """Back from padded tokens to one row per node, in the original node order.

        The exact inverse of the layout of :meth:`forward`: ``to_nodes(self(data))[n]`` is
        node ``n``'s token, and it works on any width (e.g. after attention blocks).

        Packed tokens give their ``values()``: the node rows in PyG's order, no copy.

        Shape:
            - tokens.x: (B, N_max, D'), or packed (B, n*, D')
            - Output: (N_total, D')

        Raises:
            TypeError: ``tokens`` is not ``Tokens``.
            ValueError: the mask's real count differs from ``meta["num_nodes"]``.
        """
        check_tokens("tokens", tokens)
        if tokens.is_packed:
            nodes = tokens.x.values()
        else:
            nodes = tokens.x[tokens.full_mask()]
        expected = tokens.meta.get("num_nodes")
        if expected is not None and nodes.shape[0] != expected:
            raise ValueError(
                f"tokens mask has {nodes.shape[0]} real slots but meta['num_nodes']={expected}"
            )
        return nodes

    def neighbourhood_mask(
        self, data: Data, num_hops: int = 1, *, num_heads: int | None = None
    ) -> Tensor:
        """:func:`neighbourhood_mask` for ``data``, laid out like this module's tokens.

        Shape:
            - Output: (B, N_max, N_max), or (B * num_heads, N_max, N_max); True = not allowed
        """
        _, edge_index, batch, num_graphs = self._unpack(data)
        return neighbourhood_mask(
            edge_index, batch, num_hops, num_heads=num_heads, batch_size=num_graphs
        )

    def extra_repr(self) -> str:
        return (
            f"in_channels={self.in_channels}, embed_dim={self.embed_dim}, "
            f"structural={self.structural}, max_degree={self.max_degree}, "
            f"num_eigenvectors={self.num_eigenvectors}"
            + (f", num_hops={self.num_hops}" if self.num_hops > 1 else "")
        )


def _node_offsets(data: Data, batch: Tensor, num_graphs: int | None) -> Tensor:
    """(B + 1,) node offsets: ``data.ptr`` when the Batch has it, else from ``batch``."""
    ptr = getattr(data, "ptr", None)
    if isinstance(ptr, Tensor) and ptr.dim() == 1:
        return ptr.long()
    counts = torch.bincount(batch, minlength=num_graphs or 0)
    return torch.nn.functional.pad(counts.cumsum(0), (1, 0))
