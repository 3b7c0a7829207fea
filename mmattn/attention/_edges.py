"""The layer side of :class:`~mmattn.attention.edge.EdgeAttention`: checks and the edge set.

Axis key: ``n`` query rows (flat tokens), ``m`` key rows, ``E`` edges, ``b`` items, ``h``
heads.

Both layouts are described the same way, by item offsets into the flat rows: padded
(B, L, D) tokens have ``q_off = [0, L, 2L, ...]`` (row ``b·L + i``), packed tokens the
offsets of their jagged batch (row of ``values()``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmattn import _checks as checks
from mmattn.kernels._segment import unique_edges

PROVIDER = (
    "adapters.GraphNodeSequencer provides it in Tokens.meta['edge_index'] (padded: "
    "b * L + i; packed: the row of values())"
)


def check_edge_index(edge_index: object, num_keys: int, num_queries: int) -> Tensor:
    """(2, E) integer ids in range; returns int64 ``edge_index``.

    Raises:
        TypeError: not a tensor, or not of an integer dtype.
        ValueError: not (2, E); a source outside [0, num_keys) or a target outside
            [0, num_queries).
    """
    if edge_index is None:
        raise ValueError(f"edge_index must be given to EdgeAttention, got None; {PROVIDER}")
    checks.check_integer_dtype("edge_index", edge_index, "token ids")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(
            f"edge_index must have shape (2, num_edges) (source row, target row), got "
            f"{tuple(edge_index.shape)}"
        )
    edge_index = edge_index.long()
    checks.check_range("edge_index[0] (sources, key rows)", edge_index[0], 0, num_keys,
                       "number of key tokens")
    checks.check_range("edge_index[1] (targets, query rows)", edge_index[1], 0, num_queries,
                       "number of query tokens")
    return edge_index


def check_edge_bias(edge_bias: object, num_edges: int, num_heads: int, like: Tensor) -> Tensor:
    """(E, h) floating ``edge_bias`` on the query's device.

    Raises:
        TypeError: not a floating tensor.
        ValueError: a shape other than (num_edges, num_heads); another device.
    """
    checks.check_tensor("edge_bias", edge_bias)
    checks.check_floating("edge_bias", edge_bias)
    checks.check_shape("edge_bias", edge_bias, (num_edges, num_heads), "(num_edges, num_heads)")
    checks.check_same_device("edge_bias", edge_bias, "query", like)
    return edge_bias


def items_of(rows: Tensor, offsets: Tensor) -> Tensor:
    """The item each flat row belongs to."""
    return torch.searchsorted(offsets[1:], rows.contiguous(), right=True)


def check_same_item(src: Tensor, dst: Tensor, q_off: Tensor, k_off: Tensor) -> None:
    """Raise ValueError when an edge joins two items of the batch."""
    if src.numel() == 0 or torch.compiler.is_compiling() or q_off.shape[0] <= 2:
        return
    source, target = items_of(src, k_off), items_of(dst, q_off)
    crossing = source != target
    if bool(crossing.any()):
        first = int(crossing.nonzero()[0, 0])
        raise ValueError(
            "edge_index must join tokens of the same batch item, got edge "
            f"{[int(src[first]), int(dst[first])]} from item {int(source[first])} to item "
            f"{int(target[first])}"
        )


@torch.compiler.disable  # data-dependent (ids read, duplicates merged): runs eagerly
def edge_plan(
    edge_index: object,
    edge_bias: object,
    *,
    q_off: Tensor,
    k_off: Tensor,
    like: Tensor,
    num_heads: int,
    key_real: Tensor | None,
    query_real: Tensor | None,
    key_bias: Tensor | None,
    add_self_loops: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The checked edge set of one call: (src, dst, bias) for the kernel, sorted by target.

    ``like`` is the (n, d) query rows (device and the number of query rows); a float key
    padding mask adds ``key_bias`` (m,) to the score of every edge from that key.
    """
    num_queries, num_keys = like.shape[0], int(k_off[-1])
    edge_index = check_edge_index(edge_index, num_keys, num_queries)
    if edge_index.device != like.device:
        raise ValueError(
            f"edge_index must be on the query's device {like.device}, got {edge_index.device}"
        )
    if edge_bias is not None:
        edge_bias = check_edge_bias(edge_bias, edge_index.shape[1], num_heads, like)
    src, dst, bias = prepare_edges(
        edge_index, edge_bias, q_off=q_off, k_off=k_off, key_real=key_real,
        query_real=query_real, add_self_loops=add_self_loops,
    )
    if key_bias is not None:
        extra = key_bias.index_select(0, src)[:, None].expand(-1, num_heads)
        bias = extra if bias is None else bias + extra
    return src, dst, bias


def prepare_edges(
    edge_index: Tensor,
    edge_bias: Tensor | None,
    *,
    q_off: Tensor,
    k_off: Tensor,
    key_real: Tensor | None,
    query_real: Tensor | None,
    add_self_loops: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Checked, unique (src, dst) sorted by target, self loops added, padding dropped.

    Args:
        edge_index: (2, E) int64, in range (see :func:`check_edge_index`).
        edge_bias: (E, h) or None.
        q_off, k_off: (b + 1,) item offsets of the query and key rows.
        key_real, query_real: (m,) / (n,) bool, True = a real token (None: all real).
        add_self_loops: join query position p of each item to key position p of that item.

    Raises:
        ValueError: an edge joins two items; ``edge_bias`` given with a duplicate edge.
    """
    src, dst = edge_index[0], edge_index[1]
    check_same_item(src, dst, q_off, k_off)
    num_keys = int(k_off[-1])
    loops = self_loops(q_off, k_off) if add_self_loops else None
    src, dst, bias, duplicates = unique_edges(src, dst, num_keys, loops, edge_bias)
    if duplicates and edge_bias is not None:
        raise ValueError(
            "edge_bias needs unique edges: edge_index holds some (source, target) pair more "
            "than once, so which bias applies would be ambiguous; remove the duplicates "
            "(e.g. torch_geometric.utils.coalesce) or sum their biases"
        )
    keep = None
    if key_real is not None:
        keep = key_real[src]
    if query_real is not None:
        keep = query_real[dst] if keep is None else keep & query_real[dst]
    if keep is not None and not bool(keep.all()):  # padding neither attends nor is attended
        src, dst = src[keep], dst[keep]
        bias = None if bias is None else bias[keep]
    return src, dst, bias


def self_loops(q_off: Tensor, k_off: Tensor) -> tuple[Tensor, Tensor]:
    """(src, dst): query position p of item b to key position p of item b, where both exist."""
    k_len = k_off.diff()
    if torch.equal(q_off, k_off):
        rows = torch.arange(int(q_off[-1]), device=q_off.device)
        return rows, rows
    dst = torch.arange(int(q_off[-1]), device=q_off.device)
    item = items_of(dst, q_off)
    pos = dst - q_off[item]
    keep = pos < k_len[item]
    dst, item, pos = dst[keep], item[keep], pos[keep]
    return k_off[item] + pos, dst


@torch.compiler.disable  # sparse COO tensors: built eagerly
def sparse_weights(
    weights: Tensor,
    src: Tensor,
    dst: Tensor,
    *,
    q_len: int,
    k_len: int,
    batch: int,
    average: bool,
) -> Tensor:
    """The (E, h) weights of padded rows as a sparse COO (b, [h,] i, j) tensor (coalesced).

    Rows are ``b·q_len + i`` and ``b·k_len + j``, so the result has the shape the dense
    weights of :class:`~mmattn.MultiHeadAttention` would have.
    """
    item, i = dst // max(q_len, 1), dst % max(q_len, 1)
    j = src % max(k_len, 1)
    if average:
        index = torch.stack([item, i, j])
        return torch.sparse_coo_tensor(
            index, weights.mean(dim=1), (batch, q_len, k_len), is_coalesced=True,
            check_invariants=False,
        )
    heads = weights.shape[1]
    head = torch.arange(heads, device=src.device).repeat(src.shape[0])
    index = torch.stack([t.repeat_interleave(heads) for t in (item, i, j)])
    index = torch.stack([index[0], head, index[1], index[2]])
    values = weights.reshape(-1)
    return torch.sparse_coo_tensor(
        index, values, (batch, heads, q_len, k_len), check_invariants=False
    ).coalesce()


@torch.compiler.disable
def packed_weights(
    weights: Tensor,
    src: Tensor,
    dst: Tensor,
    q_off: Tensor,
    k_off: Tensor,
    *,
    average: bool,
) -> list[Tensor]:
    """Per-item sparse COO weights (i_m, j_m), or (h, i_m, j_m), of a packed batch."""
    bounds = torch.searchsorted(dst, q_off).tolist()  # edges are sorted by target
    out = []
    for b in range(q_off.shape[0] - 1):
        part = slice(bounds[b], bounds[b + 1])
        q_len = int(q_off[b + 1] - q_off[b])
        k_len = int(k_off[b + 1] - k_off[b])
        one = sparse_weights(
            weights[part], src[part] - k_off[b], dst[part] - q_off[b], q_len=q_len,
            k_len=k_len, batch=1, average=average,
        )
        out.append(one[0])
    return out
