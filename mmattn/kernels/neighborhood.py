"""Tiled 2-D neighbourhood attention, the O(L·k²) kernel of :class:`mmattn.NeighborhoodAttention`.

Axis key: ``b`` batch, ``h`` query heads, ``k`` key/value heads, ``l`` tokens of an item,
``e`` head width, ``r`` flat rows (every item's tokens one after the other), ``n`` tiles,
``s`` query slots of a tile, ``t`` key slots of a tile, ``g`` global queries of an item,
``j`` keys of an item.

Semantics are NATTEN's ``na2d`` (clamped windows, dilation), plus global tokens; the dense
reference is :func:`mmattn.masks.neighborhood_mask`. The grid is cut into tiles of
``th × tw`` queries; a tile's queries only reach a slab of ``(th + kh - 1) × (tw + kw - 1)``
grid keys (windows are clamped inward, so the slab stays inside the grid) plus the item's
global keys. Every tile is gathered at once and all run as ONE batched attention call with
the exact window mask::

    rows (r, h, e) ─gather q_index─▶ (n, h, s, e) ┐
    rows (r, k, e) ─gather k_index─▶ (n, k, t, e) ├─ attend(mask (n, 1, s, t)) ─▶ (n, h, s, e)
    plan.allowed (n, s, t) & real key ────────────┘                 │
    global rows (b', h, g, e) attend all of their item's keys ──────┤
                                     cat(tiles, globals, zero) ─gather pick─▶ (r, h, e)

Time and memory are O(L·(th + k - 1)(tw + k - 1)) in the forward and the backward; no
(L, L) tensor exists unless weights are requested. The tile plan (:mod:`._neighborhood_plan`)
depends only on the geometry and is cached. The per-tile attention is
:func:`mmattn.kernels.dense.attend`, so the fused and explicit paths, dropout, grouped-query
heads and the "row without allowed keys gives zeros" rule are those of the dense modules.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from einops import rearrange
from torch import Tensor

from mmattn._helpers import exporting
from mmattn.kernels import dense as _kernel
from mmattn.kernels._neighborhood_export import export_attend as _export_attend
from mmattn.kernels._neighborhood_export import static_coords, static_plan
from mmattn.kernels._neighborhood_plan import (
    TILE_CHOICES,
    Item,
    Plan,
    additive_mask,
    build_plan,
    merge_key_mask,
)
from mmattn.kernels._neighborhood_terms import grid_coords, softmax_modifiers, tile_terms
from mmattn.kernels.modifiers import Modifiers, with_bias

__all__ = [
    "Item",
    "choose_tiles",
    "neighborhood_attend",
    "neighborhood_rows",
    "packed_items",
    "padded_items",
]

Grid = tuple[int, int]


def _per_item(value, count: int) -> list:
    """A per-item list from one value or a list of ``count`` values."""
    if isinstance(value, list):
        return value
    return [value] * count


def padded_items(
    batch: int,
    length: int,
    grid: Grid | Sequence[Grid],
    *,
    num_global_tokens: int = 0,
    grid_start: int | Sequence[int] | None = None,
) -> tuple[Item, ...]:
    """The items of a padded (b, l) batch: item m is flat rows ``[m·l, m·l + l)``.

    ``grid`` is one (rows, cols) for every item or a list of per-item grids. Without
    ``grid_start`` the grid starts after ``num_global_tokens`` tokens and an item's tokens
    after its grid are padding (dead); with it every token outside the grid is global.
    """
    grids = [tuple(g) for g in grid] if isinstance(grid, list) else [tuple(grid)] * batch
    starts = _per_item(num_global_tokens if grid_start is None else grid_start, batch)
    return tuple(
        Item(m * length, length, rows, cols, int(start), grid_start is not None)
        for m, ((rows, cols), start) in enumerate(zip(grids, starts))
    )


def packed_items(
    lengths: Sequence[int],
    grid: Grid | Sequence[Grid],
    *,
    num_global_tokens: int = 0,
    grid_start: int | Sequence[int] | None = None,
) -> tuple[Item, ...]:
    """The items of packed rows: item m has ``lengths[m]`` rows, one after the other."""
    count = len(lengths)
    grids = [tuple(g) for g in grid] if isinstance(grid, list) else [tuple(grid)] * count
    starts = _per_item(num_global_tokens if grid_start is None else grid_start, count)
    items, offset = [], 0
    for length, (rows, cols), start in zip(lengths, grids, starts):
        items.append(Item(offset, int(length), rows, cols, int(start), grid_start is not None))
        offset += int(length)
    return tuple(items)


@functools.lru_cache(maxsize=64)
def choose_tiles(
    items: tuple[Item, ...], kernel: tuple[int, int], dilation: tuple[int, int]
) -> tuple[int, int]:
    """Tile shape (th, tw) from a cost model: per tile ``s · t`` scores plus a fixed cost.

    A tile of th × tw queries scores ``(th + kh - 1)(tw + kw - 1)`` grid keys for each
    query: small tiles waste fewer scores, large ones make fewer, bigger matmuls and
    gather fewer halo keys. The fixed cost of a tile is worth :data:`TILE_OVERHEAD` scores
    (measured on the CPU, docs/performance.md). Sides are capped at a subgrid's size.
    """
    best, best_cost = (1, 1), math.inf
    shapes = [(-(-it.rows // dilation[0]), -(-it.cols // dilation[1])) for it in items]
    sub = dilation[0] * dilation[1]
    for th in TILE_CHOICES:
        for tw in TILE_CHOICES:
            th_ = min(th, max(r for r, _ in shapes))
            tw_ = min(tw, max(c for _, c in shapes))
            keys = (th_ + kernel[0] - 1) * (tw_ + kernel[1] - 1)
            cost = 0.0
            for rows, cols in shapes:
                tiles = sub * -(-rows // min(th_, rows)) * -(-cols // min(tw_, cols))
                cost += tiles * (th_ * tw_ * keys + TILE_OVERHEAD)
            if cost < best_cost:
                best, best_cost = (th_, tw_), cost
    return best


#: The fixed cost of one tile, in scores (see :func:`choose_tiles`).
TILE_OVERHEAD = 6144


def _pad_row(t: Tensor, fill: float | bool = 0.0) -> Tensor:
    """``t`` with one more row (the zero row every empty slot reads) along dim 0."""
    return torch.cat([t, t.new_full((1, *t.shape[1:]), fill)])


def neighborhood_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: Plan,
    *,
    key_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    modifiers: Modifiers | None = None,
    term: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Unchecked neighbourhood attention on flat rows, after :func:`build_plan`.

    Args:
        q, k, v: the rows of every item, one after the other.
        plan: the geometry (see :mod:`mmattn.kernels._neighborhood_plan`).
        key_mask: (r,) bool, True = real key, or float added to the scores; None = all real.
        dropout_p: dropout on the attention weights.
        scale: score scale; default ``1 / sqrt(e)``.
        need_weights: also return each row's weights over its item's tokens.
        modifiers: sinks and softcap (:mod:`mmattn.kernels.modifiers`; their ALiBi, if
            any, is ignored here: the grid's comes in ``term``).
        term: (n, h, s, t) additive ALiBi / table term of the tiles
            (:mod:`._neighborhood_terms`); global queries get none.

    Shape:
        - q: (r, h, e); k: (r, k, e); v: (r, k, e_v) with ``k`` dividing ``h``
        - returns: (r, h, e_v), and weights (r, h, plan.width) or None
    """
    mods = softmax_modifiers(modifiers)
    heads, width = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(width) if scale is None else scale
    n, slots, keys = plan.allowed.shape
    qz, kz, vz = _pad_row(q), _pad_row(k), _pad_row(v)
    km = None
    if key_mask is not None:
        km = _pad_row(key_mask, False if key_mask.dtype == torch.bool else float("-inf"))
    qt = rearrange(qz.index_select(0, plan.q_index), "(n s) h e -> n h s e", n=n)
    kt = rearrange(kz.index_select(0, plan.k_index), "(n t) k e -> n k t e", n=n)
    vt = rearrange(vz.index_select(0, plan.k_index), "(n t) k e -> n k t e", n=n)
    km_t = None
    if km is not None:
        km_t = rearrange(km.index_select(0, plan.k_index), "(n t) -> n 1 t", n=n)
    if km is None and not need_weights and _kernel.use_fused_attn() and not (
        mods is not None and mods.explicit
    ):
        # No key mask: every real query sees itself, every empty slot sees all; no dead row.
        out_t = _kernel.sdpa(
            qt, kt, vt, with_bias(additive_mask(plan, qt.dtype), term), dropout_p=dropout_p,
            scale=scale, groups=qt.shape[1] // kt.shape[1], dead_rows=False,
            sinks=None if mods is None else mods.sinks,
        )
        w_t = None
    else:
        mask = rearrange(merge_key_mask(plan.allowed, km_t), "n s t -> n 1 s t")
        out_t, w_t = _kernel.attend(
            qt, kt, vt, with_bias(mask, term), dropout_p=dropout_p, scale=scale,
            need_weights=need_weights, report_path=False, modifiers=mods,
        )
    parts = [rearrange(out_t, "n h s e -> (n s) h e")]
    w_g = None
    if plan.gq_index.numel():  # global queries attend every key of their item
        gq = rearrange(qz[plan.gq_index], "b g h e -> b h g e")
        gk = rearrange(kz[plan.gk_index], "b j k e -> b k j e")
        gv = rearrange(vz[plan.gk_index], "b j k e -> b k j e")
        gm = rearrange(plan.gk_valid, "b j -> b 1 1 j")
        if km is not None:
            gm = merge_key_mask(gm, rearrange(km[plan.gk_index], "b j -> b 1 1 j"))
        out_g, w_g = _kernel.attend(
            gq, gk, gv, gm, dropout_p=dropout_p, scale=scale, need_weights=need_weights,
            report_path=False, modifiers=mods,
        )
        parts.append(rearrange(out_g, "b h g e -> (b g) h e"))
    parts.append(out_t.new_zeros(1, heads, v.shape[-1]))
    out = torch.cat(parts).index_select(0, plan.pick)
    weights = None
    if need_weights:
        weights = _dense_weights(plan, w_t, w_g, q.shape[0], heads)
    return out, weights


def _dense_weights(
    plan: Plan, w_t: Tensor, w_g: Tensor | None, rows: int, heads: int
) -> Tensor:
    """Scatter tile and global weights into (r, h, width) rows over each item's tokens."""
    n, slots, keys = plan.allowed.shape
    width = plan.width
    dense = w_t.new_zeros(rows + 1, heads, width + 1)
    tile_total = n * slots
    grid_rows = torch.nonzero(plan.pick < tile_total).flatten()
    slot = plan.pick[grid_rows]
    w = rearrange(w_t, "n h s t -> (n s) h t").index_select(0, slot)
    cols = plan.k_col.index_select(0, torch.div(slot, slots, rounding_mode="floor"))
    grid_w = w.new_zeros(len(slot), heads, width + 1)
    grid_w.scatter_add_(-1, cols[:, None, :].expand(-1, heads, -1), w)
    dense.index_copy_(0, grid_rows, grid_w)
    if w_g is not None:
        g = plan.gq_index.shape[1]
        cols = plan.gk_col[:, None, None, :].expand(-1, g, heads, -1)
        glob_w = w_g.new_zeros(*cols.shape[:3], width + 1)
        glob_w.scatter_add_(-1, cols, rearrange(w_g, "b h g j -> b g h j"))
        real = plan.gq_index.flatten() < rows
        dense.index_copy_(
            0, plan.gq_index.flatten()[real], rearrange(glob_w, "b g h j -> (b g) h j")[real]
        )
    return dense[:rows, :, :width]


def neighborhood_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grid: Grid | Sequence[Grid],
    kernel_size: tuple[int, int],
    *,
    dilation: tuple[int, int] = (1, 1),
    num_global_tokens: int = 0,
    grid_start: int | Sequence[int] | None = None,
    key_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
    tiles: tuple[int, int] | None = None,
    modifiers: Modifiers | None = None,
    table: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Unchecked neighbourhood attention on a padded batch of head-split tensors.

    Args:
        q, k, v: queries, keys, values of one length ``l``.
        grid: one (rows, cols) for every item, or a list of per-item grids (item m's grid
            covers its tokens ``[g, g + rows_m · cols_m)``; the rest of the item is padding).
        kernel_size, dilation: (kh, kw) and (dh, dw); kernels odd.
        num_global_tokens: ``g``; the first g tokens see and are seen by every token.
        grid_start: the grid's first token (int or per item) when the grid sits inside the
            sequence; every token outside the grid is then global.
        key_mask: (b, l) bool, True = real key, or float added to the scores.
        dropout_p, scale: as :func:`mmattn.kernels.dense.attend`.
        need_weights: also return the dense (b, h, l, l) weights (O(l²) memory).
        tiles: tile shape; default :func:`choose_tiles`.
        modifiers: sinks, softcap and ALiBi; ALiBi's distance is Euclidean between grid
            cells, 0 for a pair with a global token (:mod:`._neighborhood_terms`).
        table: ((2 kh − 1)(2 kw − 1), h) relative-position bias table in Swin's layout
            (NAT's ``rpb``), or None.

    Shape:
        - q: (b, h, l, e); k, v: (b, k, l, e) with ``k`` dividing ``h``
        - returns: (b, h, l, e) and (b, h, l, l) weights or None

    Examples:
        >>> q = k = v = torch.randn(2, 4, 8 * 8, 16)
        >>> out, _ = neighborhood_attend(q, k, v, (8, 8), (3, 3))
        >>> out.shape
        torch.Size([2, 4, 64, 16])
    """
    batch, heads, length, _ = q.shape
    traced = exporting() or not isinstance(batch, int)  # symbolic batch: one item's plan
    items = padded_items(
        1 if traced else batch, length, grid,
        num_global_tokens=num_global_tokens, grid_start=grid_start,
    )
    if _kernel.reporting():
        _kernel.report(
            "neighborhood", _kernel.explicit_reasons(need_weights), q=q, k=k, v=v,
            mask=key_mask, dropout_p=dropout_p, is_causal=False, scale=scale,
            kernel_size=kernel_size, dilation=dilation, num_global_tokens=num_global_tokens,
            grid=grid, grid_start=grid_start, modifiers=modifiers if modifiers else None,
            position_bias=table,
        )
    slopes = modifiers.slopes if modifiers else None
    terms = {"slopes": slopes, "table": table, "kernel": tuple(kernel_size),
             "dilation": tuple(dilation), "dtype": q.dtype}
    if traced:
        if need_weights:
            raise NotImplementedError(
                "NeighborhoodAttention does not export need_weights=True; export without it"
            )
        if isinstance(grid, list) or isinstance(grid_start, (list, tuple, Tensor)):
            raise NotImplementedError(
                "NeighborhoodAttention exports only one grid (rows, cols) and one int "
                "grid_start for every item, not per-item lists"
            )
        kernel, dil = tuple(kernel_size), tuple(dilation)
        tiles = tiles or choose_tiles(items[:1], kernel, dil)  # plain Python on ints
        term = None
        if slopes is not None or table is not None:
            plan = static_plan(items[0], kernel, dil, tiles, q.device)
            term = tile_terms(plan, static_coords(items[0], q.device), **terms)
        return _export_attend(
            q, k, v, items[0], kernel, dil, tiles, key_mask,
            dropout_p=dropout_p, scale=scale, modifiers=modifiers, term=term,
        )
    if batch == 0 or length == 0:
        return _kernel.attend(q, k, v, None, need_weights=need_weights, report_path=False)
    tiles = tiles or choose_tiles(items, tuple(kernel_size), tuple(dilation))
    plan = build_plan(batch * length, items, tuple(kernel_size), tuple(dilation), tiles, q.device)
    term = None
    if slopes is not None or table is not None:
        term = tile_terms(plan, grid_coords(batch * length, items, q.device), **terms)
    rows = [rearrange(t, "b h l e -> (b l) h e") for t in (q, k, v)]
    key_rows = None if key_mask is None else key_mask.reshape(-1)
    out, weights = neighborhood_rows(
        *rows, plan, key_mask=key_rows, dropout_p=dropout_p, scale=scale,
        need_weights=need_weights, modifiers=modifiers, term=term,
    )
    out = rearrange(out, "(b l) h e -> b h l e", b=batch)
    if weights is not None:
        weights = rearrange(weights, "(b i) h j -> b h i j", b=batch)
    return out, weights
