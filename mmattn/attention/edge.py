"""Multi-head dot-product attention along the edges of a graph, in O(E) time and memory.

Axis key: ``b`` batch, ``i`` query length, ``j`` key length, ``n`` flat query rows
(``b·i``, or the packed rows), ``m`` flat key rows, ``E`` edges, ``h`` heads, ``e`` head
width, ``d`` model width (``d = h * e``).

The module shares the projections and the forward contract of
:class:`mmattn.MultiHeadAttention`; the attention step is :mod:`mmattn.kernels.segment`:
scores only on the edges, a segment softmax over the edges of each query, and a weighted
sum of the values of those edges. No (L, L) tensor is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from einops import rearrange
from torch import Tensor

from mmattn import _checks as checks
from mmattn._helpers import default, exporting
from mmattn.attention import _edges
from mmattn.attention._fx import fx_leaf
from mmattn.attention._modifiers import score_modifiers
from mmattn.attention._positions import refuse_positions
from mmattn.attention._sparse import reject_sparse_mask
from mmattn.attention.mha import MultiHeadAttention
from mmattn.kernels._segment import attend_sorted
from mmattn.kernels._segment_modifiers import edge_attend_modified
from mmattn.kernels.packed import contiguous_parts, is_jagged, jagged

__all__ = ["EdgeAttention"]


class EdgeAttention(MultiHeadAttention):
    r"""Multi-head attention along graph edges: query i attends key j for every edge (j, i).

    .. math::
        \mathrm{out}_i = W_o\,\mathrm{concat}_h \sum_{j \in \mathcal{N}(i)}
            \mathrm{softmax}_{j \in \mathcal{N}(i)}\!\left(
            \frac{q_i^h \cdot k_j^h}{\sqrt{e}} + b_{ji}^h\right) v_j^h

    :math:`\mathcal{N}(i)` holds the sources of the edges into ``i`` and, with
    ``add_self_loops``, ``i`` itself; duplicate edges count once. ``edge_bias`` (E, H)
    adds :math:`b_{ji}^h` to the scores of its edges (Graphormer / GraphGPS edge encodings;
    the edges must then be unique). On the real tokens this equals
    :class:`MultiHeadAttention` with the same weights and ``attn_mask =
    adapters.neighbourhood_mask(edge_index, batch, 1, num_heads=H)``, but time and memory
    grow as O(E·H·e), not O(N²). For k hops use :func:`mmattn.masks.k_hop_edges`.

    Edges index the flat token order, as ``Tokens.meta["edge_index"]`` holds them
    (``adapters.GraphNodeSequencer`` sets it, and blocks pass it on): row ``b·L + i`` of a
    padded (B, L, D) batch, the row of ``values()`` of a packed one (PyG's own edge_index).
    With ``key`` given, sources index the flat key order (``b·S + j``) and targets the flat
    query order (bipartite). Self loops join query position p of an item to key position p
    of the same item. Padded tokens neither attend nor are attended (edges touching them
    are dropped); a query with no edge gets a zero attention result (its output is
    ``out_proj.bias``), never NaN. Dropout acts on the attention probabilities in training.

    The default path is a memory-lean ``autograd.Function`` that keeps only the (E, H)
    probabilities for backward and rebuilds the gathered rows there; with
    ``need_weights=True`` or ``MMATTN_FUSED_ATTN=0`` the explicit twin (the formula with
    autograd) runs. The two agree. ``need_weights=True`` returns the weights as a sparse
    COO tensor of the shape :class:`MultiHeadAttention`'s dense weights would have.

    Args:
        embed_dim: model width D.
        num_heads: number of heads H; must divide ``embed_dim``.
        dropout: dropout probability on the attention probabilities (training only).
        bias: add biases to the four projections.
        add_self_loops: every token also attends itself.
        kdim, vdim: key and value widths (default ``embed_dim``).
        batch_first: inputs are (B, L, D) when True, (L, B, D) when False.
        device, dtype: factory arguments for the parameters.
        num_kv_heads: key/value heads (grouped-query attention), as
            :class:`MultiHeadAttention`; keys and values are never repeated per query head.
        sinks, softcap: score modifiers, as :class:`MultiHeadAttention` (softcap before the
            ``edge_bias``); ``alibi=True`` is refused: graph nodes have no order
            (docs/variants.md, "Score modifiers").

    Shape:
        - query: (B, L, D) or (L, D), or packed (B, l*, D); key: (B, S, kdim); value:
          (B, S, vdim)
        - key_padding_mask: (B, S), True = padding (bool) or added per key (float)
        - edge_index: (2, E) int, rows ``(source, target)`` in the flat token order
        - edge_bias: (E, H) float, or None
        - returns: (B, L, D), and when ``need_weights`` a sparse COO (B, L, S) (averaged)
          or (B, H, L, S); packed: a list of per-item (l_m, s_m) or (H, l_m, s_m)

    Raises:
        TypeError: ``add_self_loops`` is not a bool (``"no"`` or None are refused).
        ValueError / TypeError: ``edge_index`` of the wrong shape or dtype, ids negative
            or out of range, an edge between two items of the batch; ``edge_bias`` of the
            wrong shape or with duplicate edges; ``attn_mask`` or ``is_causal`` given (the
            edges are the mask); ``alibi=True``; plus every check of
            :class:`MultiHeadAttention`.

    Examples:
        >>> attn = EdgeAttention(embed_dim=16, num_heads=4)
        >>> x = torch.randn(2, 3, 16)
        >>> edge_index = torch.tensor([[0, 1, 3], [1, 2, 4]])  # 0->1, 1->2 in item 0; 0->1 in 1
        >>> out, weights = attn(x, edge_index=edge_index, need_weights=True)
        >>> out.shape, weights.shape, weights.is_sparse
        (torch.Size([2, 3, 16]), torch.Size([2, 3, 3]), True)
    """

    no_torch_twin = (
        "nn.MultiheadAttention has no edges; MultiHeadAttention(...).load_state_dict("
        "edge.state_dict()) with adapters.neighbourhood_mask(...) as attn_mask computes the "
        "same, and its to_torch() works"
    )
    cache_kinds = ()
    takes_sparse_mask = False  # the edges are the mask (attention/_sparse.py)
    #: Why ``alibi=True`` is refused (see :mod:`mmattn.attention._modifiers`).
    alibi_refusal = (
        "graph nodes have no order, so a distance between token indices would depend on how "
        "the nodes are numbered; put a distance into edge_bias instead"
    )

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        add_self_loops: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        num_kv_heads: int | None = None,
        sinks: bool = False,
        softcap: float | None = None,
        alibi: bool = False,
    ) -> None:
        self.add_self_loops = checks.check_bool("add_self_loops", add_self_loops)
        super().__init__(
            embed_dim, num_heads, dropout=dropout, bias=bias, kdim=kdim, vdim=vdim,
            batch_first=batch_first, device=device, dtype=dtype, num_kv_heads=num_kv_heads,
            sinks=sinks, softcap=softcap, alibi=alibi,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, add_self_loops={self.add_self_loops}"

    def make_cache(self, *args: Any, **kwargs: Any) -> Any:
        """EdgeAttention has no decoding cache: its edges are fixed per call.

        Raises:
            ValueError: always.
        """
        raise ValueError("EdgeAttention has no cache: its edges describe a whole graph")

    def geometry(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """``{"edge_index": meta["edge_index"]}`` (and ``edge_bias`` when meta has one).

        Raises:
            ValueError: ``meta`` has no ``"edge_index"``.
        """
        if "edge_index" not in meta:
            raise ValueError(
                f"EdgeAttention needs Tokens.meta['edge_index'], got meta keys "
                f"{sorted(meta)}; {_edges.PROVIDER}"
            )
        geometry = {"edge_index": meta["edge_index"]}
        if meta.get("edge_bias") is not None:
            geometry["edge_bias"] = meta["edge_bias"]
        return geometry

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        edge_index: Tensor,
        edge_bias: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | list[Tensor] | None]:
        """Attend along ``edge_index``; see the class docstring for shapes. ``positions``
        raises a ValueError naming it: graph nodes have no order, so no position module."""
        traced = fx_leaf(self, (query,), {
            "key": key, "value": value, "key_padding_mask": key_padding_mask,
            "need_weights": need_weights, "attn_mask": attn_mask,
            "average_attn_weights": average_attn_weights, "is_causal": is_causal,
            "edge_index": edge_index, "edge_bias": edge_bias, "positions": positions,
        })
        if traced is not None:  # torch.fx: one call_module node (see attention/_fx.py)
            return traced
        refuse_positions(self, positions)
        if exporting():
            raise NotImplementedError(
                "EdgeAttention does not export: its edge set (duplicates merged, padded "
                "tokens dropped) has a data-dependent size. Export MultiHeadAttention with the "
                "same weights and attn_mask=adapters.neighbourhood_mask(...) as an input "
                "instead (docs/deploy.md)"
            )
        reject_sparse_mask(self, attn_mask)  # TypeError naming attn_mask
        _check_no_mask(attn_mask, is_causal)
        self_attention = key is None or key is query
        key = default(key, query)
        value = default(value, key)
        if is_jagged(query) or is_jagged(key) or is_jagged(value):
            return self._packed(
                query, key, value, key_padding_mask, need_weights, average_attn_weights,
                self_attention, edge_index, edge_bias,
            )
        batched = self._check_inputs(query, key, value, key_padding_mask, None)
        if not batched:
            query, key, value = query[None], key[None], value[None]
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask[None]
        elif not self.batch_first:
            query, key, value = (rearrange(t, "l b d -> b l d") for t in (query, key, value))
        batch, q_len, k_len = query.shape[0], query.shape[1], key.shape[1]
        q_off = torch.arange(batch + 1, device=query.device) * q_len
        k_off = torch.arange(batch + 1, device=query.device) * k_len
        key_real = key_bias = None
        if key_padding_mask is not None:
            flat = key_padding_mask.reshape(-1)
            if flat.dtype == torch.bool:
                key_real = ~flat
            else:  # float: added per key; -inf forbids the key
                key_real, key_bias = ~torch.isneginf(flat), flat
        query_real = key_real if self_attention and q_len == k_len else None
        rows = (rearrange(t, "b l d -> (b l) d") for t in (query, key, value))
        out, weights, src, dst = self._attend(
            *rows, q_off, k_off, edge_index, edge_bias, key_real=key_real,
            query_real=query_real, key_bias=key_bias, need_weights=need_weights,
        )
        out = rearrange(out, "(b l) d -> b l d", b=batch, l=q_len)  # l: a batch of 0 too
        if weights is not None:
            weights = _edges.sparse_weights(
                weights, src, dst, q_len=q_len, k_len=k_len, batch=batch,
                average=average_attn_weights,
            )
        if not batched:
            out = out[0]
            weights = None if weights is None else weights[0]
        elif not self.batch_first:
            out = rearrange(out, "b l d -> l b d")
        return out, weights

    def attend_rows(
        self,
        qv: Tensor,
        q_off: Tensor,
        kv: Tensor,
        k_off: Tensor,
        vv: Tensor,
        *,
        self_attention: bool = False,
        **kwargs: Any,
    ) -> Tensor:
        """Edge attention on the packed rows (the flat token order is the row order).

        ``kwargs`` are ``forward``'s keywords: ``edge_index`` (required), ``edge_bias``;
        ``attn_mask`` and ``is_causal`` must be None / False.

        Shape:
            - qv: (t_q, embed_dim); kv: (t_k, kdim); vv: (t_k, vdim); offsets (b + 1,)
            - returns: (t_q, embed_dim)
        """
        _check_no_mask(kwargs.pop("attn_mask", None), kwargs.pop("is_causal", False))
        refuse_positions(self, kwargs.pop("positions", None))
        if "edge_index" not in kwargs:
            raise ValueError(f"edge_index must be given to EdgeAttention; {_edges.PROVIDER}")
        unknown = sorted(set(kwargs) - {"edge_index", "edge_bias"})
        if unknown:
            raise TypeError(f"EdgeAttention.attend_rows got unexpected keywords {unknown}")
        out, *_ = self._attend(
            qv, kv, vv, q_off, k_off, kwargs["edge_index"], kwargs.get("edge_bias"),
        )
        return out

    def _packed(
        self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None,
        need_weights: bool, average: bool, self_attention: bool, edge_index: Tensor,
        edge_bias: Tensor | None,
    ) -> tuple[Tensor, list[Tensor] | None]:
        from mmattn.attention._packed_checks import check_packed

        check_packed(self, query, key, value, key_padding_mask)
        qv, q_off = contiguous_parts(query)
        kv, k_off = (qv, q_off) if key is query else contiguous_parts(key)
        vv, v_off = (kv, k_off) if value is key else contiguous_parts(value)
        if not torch.equal(k_off, v_off):
            raise ValueError(
                f"key and value must have the same lengths per item, got key lengths "
                f"{k_off.diff().tolist()} and value lengths {v_off.diff().tolist()}"
            )
        out, weights, src, dst = self._attend(
            qv, kv, vv, q_off, k_off, edge_index, edge_bias, need_weights=need_weights
        )
        if weights is not None:
            weights = _edges.packed_weights(weights, src, dst, q_off, k_off, average=average)
        return jagged(out, q_off), weights

    def _attend(
        self,
        qv: Tensor,
        kv: Tensor,
        vv: Tensor,
        q_off: Tensor,
        k_off: Tensor,
        edge_index: Tensor,
        edge_bias: Tensor | None,
        *,
        key_real: Tensor | None = None,
        query_real: Tensor | None = None,
        key_bias: Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """Project the flat rows, build the edge set, attend, merge heads, ``out_proj``.

        Shape:
            - qv: (n, embed_dim); kv: (m, kdim); vv: (m, vdim); offsets (b + 1,)
            - returns: (n, embed_dim), weights (E', h) or None, and the edges (src, dst)
        """
        src, dst, bias = _edges.edge_plan(
            edge_index, edge_bias, q_off=q_off, k_off=k_off, like=qv, num_heads=self.num_heads,
            key_real=key_real, query_real=query_real, key_bias=key_bias,
            add_self_loops=self.add_self_loops,
        )
        q = rearrange(self.q_proj(qv), "n (h e) -> n h e", h=self.num_heads)
        k = rearrange(self.k_proj(kv), "m (h e) -> m h e", h=self.num_kv_heads)
        v = rearrange(self.v_proj(vv), "m (h e) -> m h e", h=self.num_kv_heads)
        dropout_p, mods = self.dropout if self.training else 0.0, score_modifiers(self)
        if mods is not None:
            out, weights = self._step(
                edge_attend_modified, q, k, v, src, dst, mods, bias=bias, dropout_p=dropout_p,
                need_weights=need_weights,
            )
        else:
            out, weights = self._step(
                attend_sorted, q, k, v, src, dst, bias=bias, dropout_p=dropout_p,
                need_weights=need_weights,
            )
        out = self.out_proj(rearrange(out, "n h e -> n (h e)"))
        return out, weights, src, dst


def _check_no_mask(attn_mask: Tensor | None, is_causal: bool) -> None:
    if attn_mask is not None:
        raise ValueError(
            "EdgeAttention takes no attn_mask (the edges are the mask), got a tensor of shape "
            f"{tuple(getattr(attn_mask, 'shape', ()))}; leave an edge out of edge_index, or "
            "use MultiHeadAttention with adapters.neighbourhood_mask"
        )
    if is_causal:
        raise ValueError(
            "EdgeAttention takes no is_causal=True (the edges are the mask); keep only edges "
            "with source <= target instead"
        )
