"""Neighbourhood attention on grids: each patch of an image (or tubelet of a video) attends
a k × k (kt × kh × kw) window, O(L·kᴺ).

Axis key: ``b`` batch, ``h`` heads, ``k`` key/value heads, ``i`` query length, ``j`` key
length, ``d`` model width, ``e`` head width (``d = h * e``), ``t`` packed rows.

The module shares projections, layout handling and the forward contract with
:class:`mmattn.MultiHeadAttention`; only the kernel differs: :mod:`mmattn.kernels.neighborhood`
tiles the grid and runs every tile against its halo of keys in one batched attention call,
so no (L, L) score matrix is built, forward or backward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from mmattn import _checks as checks
from mmattn._helpers import default, exporting
from mmattn.attention._decoding import refuse_chunk_cache
from mmattn.attention._fx import fx_leaf
from mmattn.attention._geo_modifiers import dense_terms, init_position_bias, position_table
from mmattn.attention._inputs import from_batch_first, to_batch_first
from mmattn.attention._modifiers import score_modifiers
from mmattn.attention._neighborhood_geometry import (
    call_window,
    check_exportable,
    check_geometry,
    dense_allowed,
    grid_from_meta,
    is_grid_list,
    rows_position,
    window_axes,
)
from mmattn.attention._packed_checks import check_packed, check_values
from mmattn.attention._positions import (
    check_packed_positions,
    check_positions,
    rotate,
    rotate_rows,
)
from mmattn.attention._sparse import reject_sparse_mask
from mmattn.attention.mha import MultiHeadAttention
from mmattn.kernels._neighborhood_terms import softmax_modifiers
from mmattn.kernels.dense import attend, explicit_reasons, report, reporting
from mmattn.kernels.modifiers import with_bias
from mmattn.kernels.neighborhood import (
    build_plan,
    choose_tiles,
    neighborhood_attend,
    neighborhood_rows,
    packed_items,
)
from mmattn.kernels.packed import contiguous_parts, is_jagged, jagged
from mmattn.masks import merge_masks
from mmattn.relative_position import RelativePositionBias

__all__ = ["NeighborhoodAttention"]

Grid = tuple[int, ...]


class NeighborhoodAttention(MultiHeadAttention):
    r"""Multi-head neighbourhood attention (NAT / DiNAT; NATTEN's ``na1d`` / ``na2d`` / ``na3d``)
    on image patches, video tubelets or any grid of 1 to 3 axes.

    .. math::
        \mathrm{out}_{(r,c)} = \sum_{(r',c') \in N_k(r,c)} \mathrm{softmax}\!\left(
            \frac{q_{(r,c)} k_{(r',c')}^\top}{\sqrt{e}}\right) v_{(r',c')}

    Tokens are the row-major cells of a ``grid``: ``(rows, cols)`` patches (as
    ``ImagePatcher`` makes them), ``(frames, rows, cols)`` tubelets (``VideoPatcher``) or a
    ``(length,)`` sequence, after ``num_global_tokens`` global tokens. Along an axis of n
    positions with dilation d, position p belongs to the subgrid {q : q = p mod d} of size
    m; its window is min(k, m) consecutive subgrid positions centred on p and shifted inward
    at the borders, so every query sees the same number of keys; on a ``causal`` axis (e.g.
    time) it is the (at most) k subgrid positions ending at p. A cell attends the product of
    its windows along every axis. Global tokens (class / register tokens) attend every token
    and every token attends them. Exactly :class:`MultiHeadAttention` with the same weights
    and ``attn_mask=~masks.neighborhood_mask(grid, kernel_size, dilation=..., causal=...,
    num_global_tokens=...)``, in O(L·∏k) time and memory, forward and backward.

    ``grid`` may be a list of per-item grids: in a padded batch item b's grid covers its
    first ``g + rows_b · cols_b`` tokens and the rest of the item is padding; packed
    (jagged) input takes one grid per item (NaViT). Every item behaves exactly as if it
    were alone. ``grid_start`` places the grid inside a longer sequence (fused modalities):
    every token outside the grid is then global. Blocks read all of this from
    ``Tokens.meta`` (:meth:`geometry`).

    Key padding is respected; a query whose window holds no real key gets a zero attention
    result (never NaN). ``need_weights=True`` returns the dense (L, L) map (O(L²) memory,
    from the explicit path, on request only). An extra ``attn_mask`` is honoured by a dense
    O(L²) fallback (window AND attn_mask). ``MMATTN_FUSED_ATTN=0`` switches the tiles from
    ``F.scaled_dot_product_attention`` to the explicit softmax twin.

    Args:
        embed_dim: model width D.
        num_heads: number of heads H; must divide ``embed_dim``.
        kernel_size: odd k for every axis of the call's grid, or one per axis: (kh, kw), or
            (kt, kh, kw) for a video grid. A tuple fixes the number of axes the grid has.
        dropout: dropout probability on the attention weights (training only).
        bias: add biases to the four projections.
        dilation: d >= 1 for every axis, or one per axis (DiNAT's dilated windows).
        causal: for every axis, or one bool per axis (NATTEN's ``is_causal``): e.g.
            ``(True, False, False)`` makes a video's time axis causal.
        num_global_tokens: g >= 0 tokens before the grid that attend and are attended by all.
        kdim, vdim: key and value widths (default ``embed_dim``).
        batch_first: inputs are (B, L, D) when True, (L, B, D) when False.
        device, dtype: factory arguments for the parameters.
        num_kv_heads: key/value heads (grouped-query attention), as :class:`MultiHeadAttention`.
        position: applied to q and k after the head split (e.g. ``"rotary"``), positions
            counted along each item's token order from 0, or at ``forward(...,
            positions=)`` (e.g. a :class:`~mmattn.rotary.MultiAxisRotary` at each patch's
            (frame, row, column)).
        sinks, softcap, alibi: score modifiers, as :class:`MultiHeadAttention`; ALiBi's
            distance is Euclidean between grid cells, in every axis (0 for a pair with a
            global token).
        relative_position_bias: NAT's learned bias per relative offset in the window
            (``rpb``, 2-D grids): True builds a :class:`~mmattn.position.RelativePositionBias`
            for ``kernel_size``; or pass one (``RelativePositionBias.from_nat(rpb)`` reads a
            NAT checkpoint). Offsets count in units of the dilation, as NATTEN's; 0 for a
            pair with a global token (docs/variants.md, "Score modifiers").

    Shape:
        - query: (B, L, D) or (L, D), or packed (B, L*, D); key, value: the same lengths
        - grid: (rows, cols), (frames, rows, cols) or (length,), or a list of B of them
          (one number of axes); grid_start: int or a list of B ints
        - key_padding_mask: (B, L) bool (True = padding) or float (added)
        - attn_mask: (L, L) or (B * H, L, L), module direction (dense fallback)
        - returns: (B, L, D), and weights (B, L, L) or (B, H, L, L) when ``need_weights``
          (a list of per-item maps for packed input)

    Raises:
        TypeError: ``kernel_size`` or ``dilation`` is not an int or a tuple of ints,
            ``causal`` not a bool or a tuple of bools.
        ValueError: an even kernel, a kernel or dilation < 1, per-axis tuples of different
            lengths or of other than 1 to 3 entries, ``num_global_tokens`` < 0, a
            ``relative_position_bias`` for another window or head count or a grid that is
            not 2-D, ``softcap`` <= 0; in
            ``forward``: no ``grid``, a grid whose cells do not match the tokens or whose
            axes are not those of ``kernel_size`` (the message names both), a grid list of
            the wrong length, ``is_causal=True``, key and query lengths that differ, plus
            every check of :class:`MultiHeadAttention`.

    Examples:
        >>> attn = NeighborhoodAttention(embed_dim=16, num_heads=4, kernel_size=3)
        >>> x = torch.randn(2, 6 * 5, 16)
        >>> out, weights = attn(x, need_weights=True, grid=(6, 5))
        >>> out.shape, weights.shape, int((weights[0, 0] > 0).sum())
        (torch.Size([2, 30, 16]), torch.Size([2, 30, 30]), 9)
        >>> video = NeighborhoodAttention(16, 4, kernel_size=(3, 3, 3),
        ...                               causal=(True, False, False))
        >>> video(torch.randn(2, 4 * 5 * 5, 16), grid=(4, 5, 5))[0].shape
        torch.Size([2, 100, 16])
    """

    no_torch_twin = (
        "nn.MultiheadAttention has no windows; MultiHeadAttention(...).load_state_dict("
        "nbhd.state_dict()) with ~masks.neighborhood_mask(grid, kernel_size) as attn_mask "
        "computes the same, and its to_torch() works"
    )
    cache_kinds = ()

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kernel_size: int | tuple[int, ...],
        dropout: float = 0.0,
        bias: bool = True,
        *,
        dilation: int | tuple[int, ...] = 1,
        causal: bool | tuple[bool, ...] = False,
        num_global_tokens: int = 0,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        num_kv_heads: int | None = None,
        position: nn.Module | Callable[..., Tensor] | str | None = None,
        sinks: bool = False,
        softcap: float | None = None,
        alibi: bool = False,
        relative_position_bias: bool | RelativePositionBias = False,
    ) -> None:
        self._axes, (self.kernel_size, self.dilation, self.causal) = window_axes(
            kernel_size, dilation, causal)
        self.num_global_tokens = checks.check_positive_int(
            "num_global_tokens", num_global_tokens, minimum=0
        )
        super().__init__(
            embed_dim, num_heads, dropout=dropout, bias=bias, kdim=kdim, vdim=vdim,
            batch_first=batch_first, device=device, dtype=dtype, num_kv_heads=num_kv_heads,
            position=position, sinks=sinks, softcap=softcap, alibi=alibi,
        )
        init_position_bias(self, relative_position_bias, device, dtype)

    def reset_parameters(self) -> None:
        """As :meth:`MultiHeadAttention.reset_parameters`, then the bias table (Swin's draw)."""
        super().reset_parameters()
        if getattr(self, "relative_position_bias", None) is not None:
            self.relative_position_bias.reset_parameters()

    def extra_repr(self) -> str:
        parts = [super().extra_repr(), f"kernel_size={self.kernel_size}"]
        if any(d != 1 for d in self.dilation):
            parts.append(f"dilation={self.dilation}")
        if any(self.causal):
            parts.append(f"causal={self.causal}")
        if self.num_global_tokens:
            parts.append(f"num_global_tokens={self.num_global_tokens}")
        if self.relative_position_bias is not None:
            parts.append("relative_position_bias=True")
        return ", ".join(parts)

    def geometry(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """``{"grid": ...}`` from ``meta["grid"]`` / ``meta["grids"]`` (ImagePatcher sets
        them); inside Tokens fused by MultiModalEncoder also ``"grid_start"``: the image
        span's start, so the other modalities' tokens are global.

        Raises:
            ValueError: ``meta`` has no grid (the message names the key and its adapter).
        """
        return {**super().geometry(meta), **grid_from_meta(meta)}

    def window(self, grid: Grid) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]:
        """Per-axis (kernel, dilation, causal) for a call's (checked) ``grid``: the module's
        tuples when it was built with any (the grid must have their axes), its one value on
        every axis otherwise.

        Raises:
            ValueError: a grid of another number of axes than ``kernel_size`` (the message
                names both).
        """
        return call_window(self, grid)

    def make_cache(self, *args: Any, **kwargs: Any) -> None:
        """Not available: a window of several axes has no step-by-step decoding order."""
        refuse_chunk_cache(self, kwargs)
        raise ValueError(
            "NeighborhoodAttention has no cache: a 2-D window sees patches below and right of "
            "the query, so images (and video frames) cannot be decoded token by token"
        )

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
        grid: Grid | Sequence[Grid] | None = None,
        grid_start: int | Sequence[int] | None = None,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | list[Tensor] | None]:
        """Attend each patch's window; see the class docstring for shapes.

        ``grid`` is required (keyword-only); ``grid_start`` (default ``num_global_tokens``)
        is the index of the grid's first token, and with it every other token is global.
        The geometry travels with the call (never stored on the module), so one module may
        serve several threads with different grids at once.
        """
        traced = fx_leaf(self, (query,), {
            "key": key, "value": value, "key_padding_mask": key_padding_mask,
            "need_weights": need_weights, "attn_mask": attn_mask,
            "average_attn_weights": average_attn_weights, "is_causal": is_causal,
            "grid": grid, "grid_start": grid_start, "positions": positions,
        })
        if traced is not None:  # torch.fx: one call_module node (see attention/_fx.py)
            return traced
        reject_sparse_mask(self, attn_mask)  # TypeError naming attn_mask (attention/_sparse.py)
        _check_not_causal(is_causal)
        if is_jagged(query) or is_jagged(key) or is_jagged(value):
            key = default(key, query)
            value = default(value, key)
            check_packed(self, query, key, value, key_padding_mask)
            qv, q_off = contiguous_parts(query)
            kv, k_off = (qv, q_off) if key is query else contiguous_parts(key)
            vv, _ = (kv, k_off) if value is key else contiguous_parts(value)
            out, weights = self._rows(
                qv, q_off, kv, k_off, vv, grid, grid_start, attn_mask, need_weights,
                average_attn_weights, positions,
            )
            return jagged(out, q_off), weights
        if isinstance(query, Tensor) and query.is_nested:
            raise ValueError(
                "NeighborhoodAttention takes packed input as a jagged nested tensor "
                "(layout=torch.jagged, as Tokens.pack makes it), got a strided one"
            )
        key = default(key, query)
        value = default(value, key)
        batched = self._check_inputs(query, key, value, key_padding_mask, attn_mask)
        grid, grid_start = self._check_geometry(query, batched, grid, grid_start)
        query, key, value, key_padding_mask = to_batch_first(
            self, batched, query, key, value, key_padding_mask
        )
        positions = check_positions(
            self, positions, query.shape[0] if batched else None, query.shape[1], query
        )
        q = rearrange(self.q_proj(query), "b l (h e) -> b h l e", h=self.num_heads)
        k, v = self._project_kv(key, value)
        q, k = rotate(self, q, k, 0 if positions is None else positions)
        mask = merge_masks(
            key_padding_mask, attn_mask, batch_size=q.shape[0], num_heads=self.num_heads,
            dtype=q.dtype,
        )
        out, weights = self._step(
            self._windows, q, k, v, mask, grid, grid_start,
            dropout_p=self.dropout if self.training else 0.0, need_weights=need_weights,
        )
        out = self.out_proj(rearrange(out, "b h l e -> b l (h e)"))
        return from_batch_first(self, batched, out, weights, average_attn_weights)

    def attend_rows(
        self,
        qv: Tensor,
        q_off: Tensor,
        kv: Tensor,
        k_off: Tensor,
        vv: Tensor,
        *,
        self_attention: bool = False,
        grid: Grid | Sequence[Grid] | None = None,
        grid_start: int | Sequence[int] | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Packed attention on the rows of a jagged batch: one grid per item (NaViT).

        Shape:
            - qv: (t, embed_dim); kv: (t, kdim); vv: (t, vdim); offsets (b + 1,)
            - returns: (t, embed_dim)
        """
        _check_not_causal(is_causal)
        out, _ = self._rows(
            qv, q_off, kv, k_off, vv, grid, grid_start, attn_mask, False, True, positions
        )
        return out

    def _rows(
        self, qv: Tensor, q_off: Tensor, kv: Tensor, k_off: Tensor, vv: Tensor, grid: Any,
        grid_start: Any, attn_mask: Tensor | None, need_weights: bool, average: bool,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, list[Tensor] | None]:
        """The packed forward on (t, d) rows; each item alone on its own grid."""
        check_values(self, qv, kv, vv)
        if attn_mask is not None:
            raise ValueError(
                "attn_mask must be None for packed input to NeighborhoodAttention: the window "
                "is the mask; unpack the Tokens to add a dense attn_mask"
            )
        lengths = q_off.diff().tolist()
        if k_off is not q_off and k_off.diff().tolist() != lengths:
            raise ValueError(
                f"NeighborhoodAttention needs key of the same length as query for every item, "
                f"got query lengths {lengths} and key lengths {k_off.diff().tolist()}"
            )
        grid, grid_start = check_geometry(
            grid, grid_start, lengths, self.num_global_tokens, packed=True
        )
        items = packed_items(
            lengths, grid, num_global_tokens=self.num_global_tokens, grid_start=grid_start
        )
        q = rearrange(self.q_proj(qv), "t (h e) -> t h e", h=self.num_heads)
        k = rearrange(self.k_proj(kv), "t (k e) -> t k e", k=self.num_kv_heads)
        v = rearrange(self.v_proj(vv), "t (k e) -> t k e", k=self.num_kv_heads)
        pos_rows = check_packed_positions(self, positions, lengths, qv)  # (t[, a])
        if pos_rows is not None:
            q, k = (rotate_rows(self, t, pos_rows) for t in (q, k))
        elif self.position is not None:
            q, k = (rows_position(self.position, t, lengths) for t in (q, k))
        out = weights = None
        if items:
            kernel, dilation, causal = self.window(items[0].shape)
            tiles = choose_tiles(items, kernel, dilation)
            plan = build_plan(qv.shape[0], items, kernel, dilation, tiles, qv.device,
                              causal=causal)
            dropout_p = self.dropout if self.training else 0.0
            mods, table = score_modifiers(self), position_table(self)
            if reporting():  # packed rows (the kernel reports the padded form itself)
                report("neighborhood", explicit_reasons(need_weights, mods), q=q, k=k, v=v,
                       mask=None, dropout_p=dropout_p, plan=plan, modifiers=mods,
                       position_bias=table, items=items, kernel_size=kernel,
                       dilation=dilation, causal=causal)
            out, weights = self._step(
                neighborhood_rows, q, k, v, plan, dropout_p=dropout_p,
                need_weights=need_weights, modifiers=mods, table=table,
            )
        else:
            out = q.new_zeros(0, self.num_heads, self.head_dim)
        out = self.out_proj(rearrange(out, "t h e -> t (h e)"))
        if not need_weights:
            return out, None
        maps = []
        for m, length in enumerate(lengths):
            start = int(q_off[m])
            item = rearrange(weights[start:start + length, :, :length], "i h j -> h i j")
            maps.append(item.mean(dim=0) if average else item)
        return out, maps

    def _check_inputs(
        self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None,
        attn_mask: Tensor | None, is_causal: bool = False,
    ) -> bool:
        batched = super()._check_inputs(
            query, key, value, key_padding_mask, attn_mask, is_causal
        )
        seq_dim = 1 if batched and self.batch_first else 0
        if key.shape[seq_dim] != query.shape[seq_dim]:
            raise ValueError(
                f"NeighborhoodAttention needs key of the same length as query "
                f"({query.shape[seq_dim]}), got key {tuple(key.shape)} and query "
                f"{tuple(query.shape)}"
            )
        return batched

    def _check_geometry(
        self, query: Tensor, batched: bool, grid: Any, grid_start: Any
    ) -> tuple[Any, Any]:
        """The call's checked ``(grid, grid_start)`` for a padded (or unbatched) query."""
        seq_dim = 1 if batched and self.batch_first else 0
        length = query.shape[seq_dim]
        batch = query.shape[1 - seq_dim] if batched else 1
        if not isinstance(batch, int) or not isinstance(length, int):
            check_exportable(grid, grid_start, length)
        shared = not (is_grid_list(grid) or isinstance(grid_start, (Sequence, Tensor)))
        # one grid for every item: checking one item checks them all (and, traced, no
        # guard on the batch size)
        grid, grid_start = check_geometry(
            grid, grid_start, [length] * (1 if shared else batch), self.num_global_tokens,
            packed=False,
        )
        self.window(grid[0] if isinstance(grid, list) else grid)  # the axes fit the window
        return grid, grid_start

    def _attention(self, *args: Any, **kwargs: Any) -> Any:
        """Not used: :meth:`forward` passes the grid to the kernel with the call (a dense
        attention here would silently ignore the window)."""
        raise TypeError(
            "NeighborhoodAttention attends through forward(..., grid=...): its attention step "
            "needs the call's grid, which only forward has"
        )

    def _windows(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, grid: Any, grid_start: Any,
        *, dropout_p: float, need_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """The attention step on head-split tensors, with the call's geometry and the
        module's score modifiers (all passed down with the call)."""
        mods, table = score_modifiers(self), position_table(self)
        kernel, dilation, causal = self.window(grid[0] if isinstance(grid, list) else grid)
        if table is not None and len(kernel) != 2:
            raise ValueError(
                f"relative_position_bias (NAT's table) needs a 2-D grid (rows, cols), got a "
                f"grid of {len(kernel)} axes; use alibi=True for 1-D and 3-D grids"
            )
        key_mask = None
        if mask is not None:
            if mask.shape[-2] != 1 or mask.shape[-3] != 1:  # an attn_mask: dense fallback
                # one grid for all (always so while exporting): one (1, 1, l, l) pattern
                same = exporting() and not isinstance(grid, list)
                allowed = dense_allowed(
                    grid, grid_start, 1 if same else q.shape[0], q.shape[2], kernel,
                    dilation, causal, self.num_global_tokens, q.device,
                )
                if mask.dtype == torch.bool:
                    mask = mask & allowed
                else:
                    mask = torch.where(allowed, mask, float("-inf"))
                term = dense_terms(
                    self, grid, grid_start, 1 if same else q.shape[0], q.shape[2],
                    None if mods is None else mods.slopes, table, q.device, q.dtype,
                )
                return attend(q, k, v, with_bias(mask, term), dropout_p=dropout_p,
                              need_weights=need_weights, modifiers=softmax_modifiers(mods))
            key_mask = mask[:, 0, 0]  # only key padding: (b, j), True = real key
        return neighborhood_attend(
            q, k, v, grid, kernel, dilation=dilation, causal=causal,
            num_global_tokens=self.num_global_tokens, grid_start=grid_start,
            key_mask=key_mask, dropout_p=dropout_p, need_weights=need_weights,
            modifiers=mods, table=table,
        )


def _check_not_causal(is_causal: bool) -> None:
    if is_causal:
        raise ValueError(
            "is_causal=True is not supported by NeighborhoodAttention: a window of several "
            "axes has no one causal order; build it with causal=(True, False, False) for a "
            "causal time axis, or use LocalAttention(causal=True) for sequences"
        )

